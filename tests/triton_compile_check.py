"""Compile our Triton kernels for an H200 (sm_90) on a machine without a GPU, with the arguments the
interpreter tests launch them with.

The interpreter (TRITON_INTERPRET=1) runs a kernel's Python body with numpy: it checks the arithmetic but
not what the compiler checks (a loop-carried value that changes type, an unsupported op, a wrong
constexpr), so a kernel could pass every CPU test and fail to compile on the GPU, costing a device run.
Two halves:
- `record(path)`, installed by tests/conftest.py in the interpreter children that `run_interpreter_tests`
  starts: every launch of a sketchkv kernel appends its signature (argument dtypes, scalar values,
  constexprs) to a JSON-lines file.
- `python tests/triton_compile_check.py FILE` (a fresh process, interpreter off, so the kernels are real
  JITFunctions): compiles each distinct launch through Triton's whole pipeline (TTIR -> PTX -> cubin with
  the ptxas shipped in the triton wheel) for a fake current device that reports sm_90; exits 1 with the
  compiler's message when one fails.
"""
import importlib
import json
import os
import sys

import torch

TARGET = ("cuda", 90, 32)  # H200: compute capability 9.0, warp size 32
MAX_VARIANTS = 6  # per kernel, spread over its logged launches: a type error shows in any (~0.6 s each)


def _encode(a, constexpr: bool = False):
    """One launch argument as JSON: what the compiler specialises on (a tensor's dtype, a scalar's type
    class: 1 / divisible by 16 / other, int32 or int64), a constexpr's value."""
    if isinstance(a, int) and not isinstance(a, bool) and not constexpr:
        big = 2 ** 40 if abs(a) >= 2 ** 31 else 0
        return {"value": big + (1 if a == 1 else 16 if a % 16 == 0 else 3)}
    if isinstance(a, float) and not constexpr:
        return {"value": 0.5}
    if isinstance(a, torch.Tensor):
        return {"tensor": str(a.dtype).removeprefix("torch.")}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if a is None or isinstance(a, (bool, int, float)):
        return {"value": a}
    if type(a).__name__ == "TensorDescriptor":   # a host TMA descriptor: its dtype and block shape specialise
        return {"desc": str(a.base.dtype).removeprefix("torch."), "block": list(a.block_shape)}
    raise TypeError(f"cannot record a kernel argument of type {type(a).__name__}")


def _decode(a):
    if "desc" in a:
        from triton.tools.tensor_descriptor import TensorDescriptor
        return TensorDescriptor.from_tensor(torch.empty([2 * b for b in a["block"]], dtype=getattr(torch, a["desc"])),
                                            a["block"])
    if "tensor" in a:
        return torch.empty(64, dtype=getattr(torch, a["tensor"]))  # only dtype and (aligned) address matter
    if "dtype" in a:
        return getattr(torch, a["dtype"])
    return a["value"]


def record(path: str) -> None:
    """Log every launch of a sketchkv kernel (this process interprets them) to `path`."""
    from triton.runtime.interpreter import InterpretedFunction
    import inspect
    interpret = InterpretedFunction.run
    seen = set()

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup and self.fn.__module__.startswith("sketchkv."):
            params = inspect.signature(self.fn).parameters
            const = ["constexpr" in str(p.annotation) for p in params.values()]
            line = json.dumps({"module": self.fn.__module__, "kernel": self.fn.__name__,
                               "args": [_encode(a, c) for a, c in zip(args, const)],
                               "kwargs": {k: _encode(v, True) for k, v in kwargs.items()}}, sort_keys=True)
            if line not in seen:
                seen.add(line)
                with open(path, "a") as f:
                    f.write(line + "\n")
        return interpret(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


class _FakeCudaDriver:
    """What JITFunction asks the active driver for when compiling (warmup) without a GPU."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget(*TARGET)

    def get_device_interface(self):
        return torch.cuda

    def get_active_torch_device(self):
        return torch.device("cpu")


def compile_all(path: str) -> int:
    """Compile up to MAX_VARIANTS logged launches per kernel for sm_90; one line per kernel; -> failures."""
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compile with the interpreter off"
    from triton.runtime import driver
    driver.set_active(_FakeCudaDriver())
    by_kernel = {}
    for line in sorted(set(open(path).read().split("\n")) - {""}) if os.path.exists(path) else []:
        rec = json.loads(line)
        by_kernel.setdefault(f"{rec['module']}.{rec['kernel']}", []).append(rec)
    failed = 0
    for name, recs in sorted(by_kernel.items()):
        picked = recs[::-(-len(recs) // MAX_VARIANTS)]
        for rec in picked:
            kernel = getattr(importlib.import_module(rec["module"]), rec["kernel"])
            try:
                kernel.warmup(*map(_decode, rec["args"]), grid=(1,), **{k: _decode(v) for k, v in rec["kwargs"].items()})
            except Exception as e:  # the compiler's own message says where
                failed += 1
                print(f"FAILED to compile {name} for sm_{TARGET[1]} with {rec['kwargs']}:\n{e}\n")
        print(f"compiled {name} for sm_{TARGET[1]}: {len(picked)} of {len(recs)} logged variants")
    return failed


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/triton_compile_check.py LAUNCHES.jsonl")
    sys.exit(1 if compile_all(sys.argv[1]) else 0)
