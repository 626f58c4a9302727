"""Kernels: a PyTorch reference and, where one pays, a Triton kernel beside it, with one dispatch each."""
import os


def _fix_interpreter_loop_bounds() -> None:
    """triton 3.6's interpreter does int(1-element array) for runtime loop bounds, a TypeError since numpy 2.4
    (triton#9171). The same one-line fix as upstream PR #9172; idempotent. Here, so that every kernel module
    gets it whichever is imported first."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    if getattr(ti._patch_lang_tensor, "_sketchkv_fix", False):
        return
    orig = ti._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._sketchkv_fix = True
    ti._patch_lang_tensor = _patch_lang_tensor


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_loop_bounds()
