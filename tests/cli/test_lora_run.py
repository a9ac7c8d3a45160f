"""``boxcar run --lora-modules``: one offline run on one engine whose lines name the base model
or any registered adapter, mixed, sharing steps; a line naming anything else fails alone; an
adapter that cannot be served fails the start (exit 2) naming it."""

from __future__ import annotations

import json

import pytest

from cli import main as cli
from tests.conftest_services import completion_line, jsonl
from tests.openai_shapes import error_of

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    from tests.engine.test_lora import save_adapter

    root = tmp_path_factory.mktemp("run-adapters")
    return {
        "fr": save_adapter(tiny_model_dir, root / "fr", 1, r=4, lora_alpha=16,
                           target_modules=["q_proj", "v_proj", "down_proj"]),
        "legal": save_adapter(tiny_model_dir, root / "legal", 2, r=8, lora_alpha=8,
                              use_rslora=True, target_modules=["o_proj", "gate_proj"]),
    }


def lora_args(adapters: dict[str, str]) -> list[str]:
    """vLLM's form: one flag, every adapter after it."""
    return ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]


def test_run_mixes_base_and_adapters(tiny_model_dir, adapters, tmp_path):
    from engine import LLM, SamplingParams

    prompts = ["Once upon a time", "The cat sat", "Hello there"]
    models = [None, tiny_model_dir.name, "fr", "legal"]
    lines = [completion_line(f"{i}-{j}", prompt, max_tokens=6, temperature=0,
                             **({} if model is None else {"model": model}))
             for i, prompt in enumerate(prompts) for j, model in enumerate(models)]
    lines.append(completion_line("other", "Hi", model="de"))
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(lines))
    status = cli.main(["run", str(source), "-o", str(output), "--model", str(tiny_model_dir),
                       "--dtype", "float32", "--no-progress", *lora_args(adapters)])
    assert status == cli.EXIT_LINES_FAILED  # the one line naming 'de'
    results = {}
    for raw in output.read_text().splitlines():
        line = json.loads(raw)
        results[line["custom_id"]] = line
    error = error_of(results.pop("other"))
    assert error["code"] == "model_not_found" and "fr, legal" in error["message"]

    llm = LLM(str(tiny_model_dir), dtype="float32",
              lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    params = SamplingParams(temperature=0, max_tokens=6)
    for j, model in enumerate(models):
        lora = model if model in adapters else None
        expected = llm.generate(prompts, params, lora_name=lora)
        for i, out in enumerate(expected):
            body = results[f"{i}-{j}"]["response"]["body"]
            assert body["choices"][0]["text"] == out.outputs[0].text, (model, i)
            assert body["model"] == (lora or tiny_model_dir.name)
    texts = {m: [results[f"{i}-{j}"]["response"]["body"]["choices"][0]["text"]
                 for i in range(len(prompts))] for j, m in enumerate(models)}
    assert texts["fr"] != texts[None] and texts["legal"] != texts[None]


def test_run_refuses_a_bad_adapter_at_start(tiny_model_dir, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([completion_line("a", "Hi")]))
    status = cli.main(["run", str(source), "-o", str(tmp_path / "out.jsonl"), "--model",
                       str(tiny_model_dir), "--no-progress", "--lora-modules",
                       f"broken={tmp_path}"])
    assert status == 2
    assert "LoRA adapter 'broken'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:  # argparse refuses the item itself
        cli.main(["run", str(source), "-o", str(tmp_path / "out.jsonl"), "--model",
                  str(tiny_model_dir), "--lora-modules", "no-path"])
    assert bad.value.code == 2 and "NAME=PATH" in capsys.readouterr().err


def test_lora_options_come_from_the_config_fields():
    args = cli.build_parser().parse_args([
        "run", "in.jsonl", "-o", "o", "--lora-modules", "a=/x", "--lora-modules", "b=/y",
        "--max-loras", "4", "--max-lora-rank", "32", "--max-cpu-loras", "6"])
    assert cli.engine_config_kwargs(args) == {
        "model": args.model, "lora_modules": ["a=/x", "b=/y"], "max_loras": 4,
        "max_lora_rank": 32, "max_cpu_loras": 6}


JSON_C = '{"name": "c", "path": "/z", "base_model_name": "SmolLM2-135M-Instruct"}'


@pytest.mark.parametrize("argv", [
    ["in.jsonl", "-o", "o", "--lora-modules", "a=/x", "b=/y", "c=/z"],
    ["in.jsonl", "-o", "o", "--lora-modules", "a=/x", "--lora-modules", "b=/y",
     "--lora-modules", "c=/z"],
    ["in.jsonl", "--lora-modules", "a=/x", "b=/y", "-o", "o", "--lora-modules", JSON_C],
    ["--lora-modules", "a=/x", "b=/y", JSON_C, "-o", "o", "in.jsonl"],
    ["-o", "o", "--lora-modules", '{"name": "a", "path": "/x"}', "b = /y", "c=/z", "--",
     "in.jsonl"],
], ids=["one-flag", "repeated", "mixed", "file-last", "json-and-dashdash"])
def test_run_takes_vllms_lora_modules_forms(argv):
    args = cli.build_parser().parse_args(["run", *argv])
    assert args.input == "in.jsonl" and args.output == "o"
    assert cli.engine_config_kwargs(args)["lora_modules"] == ["a=/x", "b=/y", "c=/z"]


@pytest.mark.parametrize("items, words", [
    (["no-path"], ["'no-path'", "NAME=PATH"]),
    (["=/p"], ["'=/p'", "NAME=PATH"]),
    (["a="], ["'a='", "NAME=PATH"]),
    (["a=/x", "a=/y"], ["'a=/y'", "'a' is given twice"]),
    (["a=/x", "--lora-modules", '{"name": "a", "path": "/y"}'], ["'a' is given twice"]),
    (['{"name": "a"}'], ['"path"']),
    (['{"name": "a=b", "path": "/p"}'], ["without '='"]),
    (['{"name": "a", "path": "/p", "rank": 8}'], ["unknown keys ['rank']"]),
    (['{"name": "a", '], ["not valid JSON"]),
])
def test_a_bad_lora_item_is_an_argparse_error_naming_it(items, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["run", "in.jsonl", "-o", "o", "--lora-modules", *items])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --lora-modules: bad item" in err
    for word in words:
        assert word in err


def test_a_file_after_the_adapter_list_is_named_as_the_bad_item(capsys):
    """The list runs to the next option, as in vLLM: a positional typed after it is taken as an
    adapter, and the error says where the file goes."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--lora-modules", "a=/x", "in.jsonl", "-o", "o"])
    assert ("bad item 'in.jsonl'" in (err := capsys.readouterr().err)
            and "a file argument goes before --lora-modules" in err)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "-o", "o", "--lora-modules", "a=/x"])
    assert "required: input" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_serve_and_worker_take_lora_modules_into_the_settings(command, monkeypatch):
    from cli.service_commands import _settings_from
    from service.served_models import configured_adapters

    for name in ("BOXCAR_ENGINE_OPTIONS", "BOXCAR_MODEL", "BOXCAR_SERVED_MODEL_NAME"):
        monkeypatch.delenv(name, raising=False)
    args = cli.build_parser().parse_args([
        command, "--lora-modules", "fr=adapters/fr", "legal=/srv/legal", "--max-loras", "2",
        "--lora-modules", '{"name": "de", "path": "adapters/de"}'])
    settings = _settings_from(args)
    assert settings.engine_options == {
        "lora_modules": ["fr=adapters/fr", "legal=/srv/legal", "de=adapters/de"], "max_loras": 2}
    assert configured_adapters(settings) == {"fr": "SmolLM2-135M-Instruct",
                                             "legal": "SmolLM2-135M-Instruct",
                                             "de": "SmolLM2-135M-Instruct"}
