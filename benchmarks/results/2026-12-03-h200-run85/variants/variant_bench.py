"""Run benchmarks/bench_sketch_score.py with sketchkv.ops.sketch replaced by a variant file."""
import importlib.util, runpy, sys
spec = importlib.util.spec_from_file_location("sketchkv.ops.sketch", sys.argv[1])
m = importlib.util.module_from_spec(spec)
sys.modules["sketchkv.ops.sketch"] = m
spec.loader.exec_module(m)
sys.argv = ["benchmarks/bench_sketch_score.py"] + sys.argv[2:]
runpy.run_path("benchmarks/bench_sketch_score.py", run_name="__main__")
