"""The embedding path: packed pooling forward passes, embedding requests and their inputs."""
