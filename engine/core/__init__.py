"""Scheduler-side bookkeeping: requests, the token-budget scheduler, KV block tables,
stop strings, parallel sampling and structured-output state. Pure CPU: no device tensor here."""
