"""Run a sketchkv command with the W4A16 GEMM's TUNED table patched from w4a16_flag.py studies (device scripts: a
study's winners tried in the engine before they are committed).

    python benchmarks/next/tuned_from_study.py /tmp/r127/x_major.json [more.json] -- bench agents ...

For every (shape, M) row of the studies whose best flipped config beats the shipped one by >= 3%, TUNED[(M bucket,
N, K)] becomes that config; each change is printed first.
"""
import json
import sys
from dataclasses import fields

sys.path.insert(0, ".")
from sketchkv.ops import w4a16_gemm as wg  # noqa: E402


def main(argv):
    cut = argv.index("--")
    names = {f.name for f in fields(wg.Config)}
    for path in argv[:cut]:
        for r in json.load(open(path))["rows"]:
            shipped, best = r["shipped"]["us"], r["best"]["us"]
            if best < 0.97 * shipped:
                cfg = wg.Config(**{k: v for k, v in r["best"]["config"].items() if k in names})
                wg.TUNED[(wg.m_bucket(r["M"]), r["N"], r["K"])] = cfg
                print(f"TUNED {r['shape']} M={r['M']}: {shipped:.1f} -> {best:.1f} us {cfg}", flush=True)
    from sketchkv.cli import main as cli
    return cli(argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
