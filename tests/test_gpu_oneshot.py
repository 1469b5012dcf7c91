"""The one-shot GPU run (research/bench/gpu_oneshot.py) in its CPU mode, and the prepare script's
sizing (research/bench/gpu_prepare.py): known to run before it first meets a GPU (issue 58)."""
import json

import pytest

from research.bench import gpu_oneshot, gpu_prepare


@pytest.mark.integration  # a whole benchmark run (~20 s of CPU), not the quick tier
def test_every_part_runs_on_the_cpu_and_the_file_holds_each_part(tmp_path):
    res = gpu_oneshot.main(["--size", "tiny", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_oneshot.json").read_text())
    assert list(saved["parts"]) == list(gpu_oneshot.PARTS) == ["env", "sampling", "update", "rewards", "lora_io", "reference"]
    for name, part in saved["parts"].items():
        assert "error" not in part, (name, part.get("error"))
    parts = {k: v["result"] for k, v in res["parts"].items()}
    tiny = gpu_oneshot.SIZES["tiny"]
    assert [r["batch"] for r in parts["sampling"]["float32"]["rows"]] == tiny["sample_batches"]
    assert all(r["images_per_s"] > 0 for r in parts["sampling"]["float32"]["rows"] + parts["update"]["float32"]["rows"])
    assert all(parts["rewards"][m]["finite"] and parts["rewards"][m]["params"] > 0 for m in ("imagereward", "hpsv2"))
    assert parts["lora_io"]["tensors"] > 0 and parts["lora_io"]["bytes"] > 0
    ref = tiny["reference"]
    assert [e["reward_queries"] for e in parts["reference"]["epochs"]] == [ref["batch"] * ref["batches"] * (i + 1) for i in range(2)]


def test_a_spent_budget_skips_the_rest_and_keeps_what_was_measured():
    args = type("A", (), {})()
    for k, v in gpu_oneshot.SIZES["tiny"].items():
        setattr(args, k, v)
    args.size, args.resolution, args.steps, args.guidance, args.peak_tflops = "tiny", 32, 2, 7.5, 989.0
    out = gpu_oneshot.part_throughput(args, gpu_oneshot.Budget(0.0), "sampling")
    assert [r.get("skipped") for r in out["float32"]["rows"]] == ["time budget spent"] * len(args.sample_batches)


def test_the_prepare_script_sizes_what_travels_and_prints_the_command(tmp_path):
    dest = tmp_path / ".whl"
    dest.mkdir()
    (dest / "a-1.0-py3-none-any.whl").write_bytes(b"x" * 2**20)
    size = gpu_prepare.travelling_bytes(dest)
    assert size["wheels"] == 2**20 and size["total"] == size["tree"] + 2**20 and size["tree"] > 0
    out = gpu_prepare.main(["--dest", str(dest), "--skip-download"])
    assert out["fits"] == (out["mib"]["total"] <= 64)
    assert "--no-index --no-deps" in out["command"] and "-m research.bench.gpu_oneshot --out $OUT" in out["command"]
    with pytest.raises(SystemExit, match="over the 0.001 MiB limit"):
        gpu_prepare.main(["--dest", str(dest), "--skip-download", "--limit-mib", "0.001"])
