"""``bench.step_overhead``: the phases of a step over the real scheduler, input batch, sampler
and output handling add up, in every case the bench runs (a few steps, a few sequences); and
``bench.sampler`` times every setting."""

from __future__ import annotations

import json

from bench import step_overhead


def test_every_case_reports_its_phases(tmp_path, capsys):
    out = tmp_path / "figures.json"
    assert step_overhead.main(["--seqs", "8", "--steps", "3", "--threads", "1", "--vocab", "512",
                               "--structured", "--lora", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    cases = {(r["case"]["mode"], r["case"]["sampling"], r["case"]["structured"],
              r["case"]["lora"]) for r in results}
    assert cases == {("decode", "greedy", False, False), ("decode", "sampled", False, False),
                     ("mixed", "greedy", False, False), ("mixed", "sampled", False, False),
                     ("decode", "greedy", True, False), ("decode", "greedy", False, True)}
    for r in results:
        phases = sum(r[p] for p in ("schedule", "prepare", "forward", "sample", "update"))
        assert r["forward"] > 0 and r["schedule"] > 0 and r["update"] > 0
        assert abs(phases + r["rest"] - r["step"]) < 1e-6 * max(r["step"], 1)
        assert r["host"] == r["step"] - r["forward"] and r["us_per_seq"] == r["host"] / 8
    assert "us_per_seq" in capsys.readouterr().out


def test_async_times_each_case_both_ways(tmp_path, capsys):
    out = tmp_path / "figures.json"
    assert step_overhead.main(["--seqs", "8", "--steps", "3", "--threads", "1", "--vocab", "512",
                               "--modes", "decode", "--sampling", "greedy", "--structured",
                               "--async", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [(r["case"]["structured"], r["async"]) for r in results] == [
        (False, False), (False, True), (True, False), (True, True)]
    for r in results:
        assert r["step"] > 0 and r["device"] > 0 and 0 < r["host"] <= r["step"]
        # synchronous steps never wait on a step thread; async ones do, structured rows' too
        # (a grammar advances where its tokens are drawn)
        assert (r["wait"] > 0) == r["async"]
    assert "wait" in capsys.readouterr().out


def test_the_sampler_bench_times_every_setting(monkeypatch, capsys):
    import sys

    from bench import sampler

    monkeypatch.setattr(sys, "argv", ["bench.sampler", "--rows", "4", "--vocab", "300",
                                      "--repeats", "1"])
    sampler.main()
    lines = capsys.readouterr().out.splitlines()
    for setting in ("top_k=50", "top_p=0.9", "top_k=50 top_p=0.9", "temperature only"):
        assert any(setting in line and len(line.split()) >= 5 for line in lines), setting
