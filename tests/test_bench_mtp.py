"""benchmarks/bench_mtp.py on the CPU with a random tiny hybrid + MTP: the report runs end to end, and
--prefix-cached serves the timed runs' prompts from the prefix cache (so its tok/s time decode)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("cached", [False, True])
def test_bench_mtp_times_decode_with_prefix_cached_prompts(tmp_path, cached):
    out = tmp_path / "mtp.json"
    cmd = [sys.executable, "benchmarks/bench_mtp.py", "--tiny", str(tmp_path / "tiny"), "--n", "1", "--styles", "copy",
           "--prompts", "2", "--context", "300", "--max-tokens", "8", "--repeats", "1", "--out", str(out),
           "--option", "device=cpu"] + (["--prefix-cached", "--phases"] if cached else [])
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.load(open(out))
    assert r["timing"].startswith("decode" if cached else "end-to-end")
    rows = r["styles"]["copy"]
    assert set(rows) == {"0", "1"} and rows["1"]["identical_to_baseline"]
    for row in rows.values():
        assert (row["prompt_cached_mean"] > 0) == cached, row
    if cached:  # --phases: synced wall time per engine phase; the phases add up to (most of) the run
        ph = rows["1"]["phases"]
        assert {"scheduler.schedule", "spec.propose", "runner.run", "spec.commit"} <= set(ph["ms"]), ph
        total = sum(v["ms"] for v in ph["ms"].values())
        assert 0.5 * ph["wall_s"] * 1e3 < total <= ph["wall_s"] * 1e3, ph
