"""Session-21 debug: was run 77's add-back kernel (tf32x3, 32 rows per program) wrong at some shape? Compare the old and
the new kernel with the torch reference at ranks 16 / 32 / 64, in place on bf16 rows, and write-then-read round trips."""
import sys, torch
sys.path.insert(0, "scratch")
import old_sketch_base as old
from sketchkv.ops import sketch_base as new
from sketchkv.ops.sketch import sketch_keys_ref
for H, D, r in [(2, 64, 16), (4, 64, 32), (4, 256, 64), (2, 128, 16)]:
    g = torch.Generator(device="cuda").manual_seed(r + D)
    basis = torch.linalg.qr(torch.randn(H, D, D, device="cuda", generator=g))[0][..., :r].contiguous()
    mean = torch.randn(H, D, device="cuda", generator=g)
    keys = torch.randn(4096, H, D, device="cuda", generator=g) * 3 + mean
    sk, sc = sketch_keys_ref(keys, mean, basis)
    sk, sc = sk.contiguous().view(64, 64, H, r // 2), sc.contiguous().view(64, 64, H)
    slots = torch.randint(-1, 4096, (5000,), device="cuda", generator=g)
    ref = new.sketch_base_ref(slots, sk, sc, mean, basis)
    for name, mod in (("old", old), ("new", new)):
        x = keys[slots.clamp_min(0)].to(torch.bfloat16)
        b = mod.apply_sketch_base(torch.zeros(5000, H, D, device="cuda"), slots, sk, sc, mean, basis, 1)
        res = mod.apply_sketch_base(x, slots, sk, sc, mean, basis, -1, out=torch.empty(5000, H, D, device="cuda"))
        back = mod.apply_sketch_base(res.to(torch.bfloat16), slots, sk, sc, mean, basis, 1)
        print(f"H{H} D{D} r{r} {name}: base max err {(b - ref).abs().max().item():.2e} (|base| {ref.abs().max().item():.1f}); "
              f"round trip max err {(back.float() - x.float()).abs().max().item():.2e}", flush=True)
