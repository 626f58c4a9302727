"""Quality-evaluation harness (sketchkv eval kld / recall / agents): end to end on a tiny random checkpoint, the
prune-at-prefill baseline's mechanics, and a regression gate on the reference model once it ships."""
import json
import os

import pytest
import torch

from sketchkv.cli import main as cli_main
from sketchkv.config import default_model
from sketchkv.engine.context import Context, set_context
from sketchkv.eval import common as C
from sketchkv.eval.prune import PruneAttention, select_keep, snapkv_scores
from sketchkv.layers.attention import Attention

SMALL = "k32:sparse=true,top_k=32,sink_tokens=4,recent_tokens=32,dense_threshold=0"
FULL = "full:sparse=true,top_k=4096,sink_tokens=4,recent_tokens=32,dense_threshold=0"


def _code(n_funcs: int = 160) -> str:
    """Held-out-like Python: many short functions (short copy answers keep the CPU test fast)."""
    out = ["import math\n\n"]
    for i in range(n_funcs):
        out.append(f"def helper_{i}(x, y):\n    z = x * {i % 13} + y\n    w = math.sqrt(abs(z)) + {i}\n"
                   f"    return w - y // {i % 5 + 1}\n\n\n")
        if i % 4 == 0:
            out.append(f"class Node{i}:\n    def __init__(self, v):\n        self.v = v\n\n"
                       f"    def value(self):\n        return self.v + {i}\n\n\n")
    return "".join(out)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from conftest import make_checkpoint
    from sketchkv import LLM
    from sketchkv.kv.fit_basis import fit_basis
    root = tmp_path_factory.mktemp("ev")
    path = str(root / "q35")
    make_checkpoint(path, "qwen3_5_text", num_hidden_layers=8, max_position_embeddings=8192)
    data = root / "heldpkg"
    data.mkdir()
    for j in range(3):
        (data / f"mod{j}.py").write_text(_code().replace("helper_", f"h{j}_").replace("Node", f"N{j}_"))
    calib = os.path.join(path, "calib.txt")
    with open(calib, "w") as f:
        f.write(_code(60))
    llm = LLM(path, device="cpu", block_size=16)
    fit_basis(llm, [calib], rank=8, max_tokens=2048, seq_len=1024, out=os.path.join(path, "key_basis.safetensors"))
    return path, str(data), root


ENGINE = ["--device", "cpu", "--block-size", "16", "--quiet"]


def test_kld_end_to_end(setup, capsys):
    path, data, root = setup
    out = str(root / "out")
    rc = cli_main(["eval", "kld", data, "--model", path, "--lengths", "1024", "2048", "--continuation", "8",
                   "--samples", "2", "--candidate", "dense-again:sparse=false", "--candidate", SMALL,
                   "--candidate", FULL, "--baseline", "full", "--out-dir", out, *ENGINE])
    assert rc == 0
    for ext in ("json", "md", "png"):
        assert os.path.getsize(os.path.join(out, f"kld.{ext}")) > 0
    r = json.load(open(os.path.join(out, "kld.json")))
    cfg = r["configs"]
    assert set(cfg) == {"floor:batch+chunk", "dense-again", "k32", "full"}
    for e in cfg.values():
        for stats in [e["overall"], *e["by_length"].values()]:
            assert stats["n_tokens"] > 0 and all(v is None or v == v for v in stats.values())  # no NaN
            assert 0 <= stats["kl_mean"] < 10 and 0 <= stats["top1"] <= 1
    # dense against itself through the same path: identical distributions
    assert cfg["dense-again"]["overall"]["kl_mean"] == 0.0 and cfg["dense-again"]["overall"]["top1"] == 1.0
    # sparse with top_k >= context selects every token: the dense result
    assert cfg["full"]["overall"]["kl_mean"] < 1e-6 and cfg["full"]["overall"]["top1"] == 1.0
    # small k really is approximate, and the floor is far below it
    assert cfg["k32"]["overall"]["kl_mean"] > 1e-5
    assert cfg["floor:batch+chunk"]["overall"]["kl_mean"] < cfg["k32"]["overall"]["kl_mean"] / 100
    assert r["prompt_lens"] == {"1024": 1024, "2048": 2048} and cfg["k32"]["overall"]["n_tokens"] == 4 * 8
    # against the baseline (full = dense up to rounding), token by token: the paired difference of the KLs to dense
    # is the difference of their means (same tokens), and k32's KL from full is its KL from dense
    assert "vs_baseline" not in cfg["full"] and "vs_baseline" not in cfg["floor:batch+chunk"]
    vb = cfg["k32"]["vs_baseline"]
    for key, v in [("overall", vb["overall"])] + [(L, vb["by_length"][L]) for L in ("1024", "2048")]:
        mine, base = (cfg["k32"][key] if key == "overall" else cfg["k32"]["by_length"][key],
                      cfg["full"][key] if key == "overall" else cfg["full"]["by_length"][key])
        assert v["n_tokens"] == mine["n_tokens"]
        assert v["kl_diff_mean"] == pytest.approx(mine["kl_mean"] - base["kl_mean"], rel=1e-9, abs=1e-12)
        assert v["kl_direct_mean"] == pytest.approx(mine["kl_mean"], rel=1e-2, abs=1e-6)
        assert v["top1_vs_baseline"] == pytest.approx(mine["top1"])
        assert v["kl_diff_ci95"] is not None and v["kl_diff_over_floor"] is None or v["kl_diff_over_floor"] > 0
    md = open(os.path.join(out, "kld.md")).read()
    assert "dense noise floor" in md and "k32" in md and "kld.png" in md and "Against the baseline `full`" in md
    rc = cli_main(["eval", "kld", data, "--model", path, "--candidate", SMALL, "--candidate", FULL,
                   "--baseline", "nope", "--out-dir", out, *ENGINE])
    assert rc != 0 and "--baseline 'nope' must name one of at least two candidates" in capsys.readouterr().err
    _replots_into_out_dir(os.path.join(out, "kld.json"), "kld", root)


def _replots_into_out_dir(json_path: str, cmd: str, root) -> None:
    """--from-json with --out-dir writes the Markdown and plot there, and leaves the ones beside the JSON alone."""
    md = json_path[:-len(".json")] + ".md"
    before, mtime = open(md).read(), os.path.getmtime(md)
    other = str(root / f"replot-{cmd}")
    assert cli_main(["eval", cmd, "--from-json", json_path, "--out-dir", other]) == 0
    for ext in ("json", "md", "png"):
        assert os.path.getsize(os.path.join(other, f"{cmd}.{ext}")) > 0
    assert open(os.path.join(other, f"{cmd}.md")).read() == before and os.path.getmtime(md) == mtime


def test_recall_end_to_end(setup):
    path, data, root = setup
    out = str(root / "out")
    rc = cli_main(["eval", "recall", data, "--model", path, "--lengths", "1024", "2048", "--samples", "1",
                   "--candidate", SMALL, "--check-generate", "1", "--out-dir", out, *ENGINE])
    assert rc == 0
    for ext in ("json", "md", "png"):
        assert os.path.getsize(os.path.join(out, f"recall.{ext}")) > 0
    r = json.load(open(os.path.join(out, "recall.json")))
    assert set(r["configs"]) == {"dense", "k32"}
    for e in r["configs"].values():
        for L in ("1024", "2048"):
            for kind in ("lookup", "copy"):
                x = e["by_length"][L][kind]
                assert x["n"] == 1 and 0 <= x["exact"] <= 1 and 0 <= x["token_acc"] <= 1
                assert x["mean_doc_tokens"] <= int(L) + 8
        for c in e["generate_check"]:  # teacher-forced exact match == real greedy generation
            assert c["teacher_forced_exact"] == c["generate_exact"]
    assert all(d["answer_tokens"] > 0 for d in r["documents"].values())
    _replots_into_out_dir(os.path.join(out, "recall.json"), "recall", root)


def test_agents_end_to_end(setup):
    path, data, root = setup
    out = str(root / "out")
    rc = cli_main(["eval", "agents", data, "--model", path, "--lengths", "768", "--samples", "1", "--turns", "2",
                   "--kinds", "lookup", "--candidate", SMALL, "--out-dir", out, *ENGINE])
    assert rc == 0
    for ext in ("json", "md", "png"):
        assert os.path.getsize(os.path.join(out, f"agents.{ext}")) > 0
    r = json.load(open(os.path.join(out, "agents.json")))
    assert set(r["configs"]) == {"dense", "k32", "prune"}
    assert r["settings"]["prune"]["sinks"] == 4 and r["settings"]["prune"]["top_k"] == 32  # k32's budget
    for name, e in r["configs"].items():
        assert [t["n"] for t in e["by_length"]["768"]["by_turn"]] == [1, 1]
        assert e["prefix_cache_hit_rate"] > 0.3  # turn 2 re-sends the conversation: served from the cache
        t2 = [t for t in e["turns"] if t["turn"] == 2][0]
        assert t2["cached_tokens"] >= r["conversations"][0]["tokens"] // 2
        if name == "prune":
            assert all(0 <= t["part_kept"] <= 1 for t in e["turns"])


def test_candidate_parsing():
    c = C.parse_candidates(["a:sparse=true,top-k=64,--sparse-recent-tokens=8", "default"], 8192)
    assert c[0].options == {"sparse": True, "sparse_top_k": 64, "sparse_recent_tokens": 8}
    assert c[1].options["sparse"] and c[1].options["sparse_top_k"] == 64  # 2048 scaled by 8192 / 262144
    assert C.parse_candidates(None, 262144)[0].sparse_budget() == (64, 2048, 1024)  # the seed's knobs
    from sketchkv.errors import SketchKVError
    for bad in ["nocolon", "x:nope=1", "x:sparse=maybe", "floor:sparse=true"]:
        with pytest.raises(SketchKVError):
            C.parse_candidates([bad], 8192)


# ----------------------------------------------------------------------------------------------------------
# Prune-at-prefill baseline
# ----------------------------------------------------------------------------------------------------------
def _ctx(start, n, table, bs):
    pos = torch.arange(start, start + n)
    slots = table[pos // bs].long() * bs + pos % bs
    return Context(cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                   seq_lens=torch.tensor([start + n], dtype=torch.int32), slot_mapping=slots,
                   block_tables=table[None], state_slots=torch.tensor([0]), query_lens=[n], context_lens=[start],
                   is_decode=n == 1 and start > 0, max_seq_len=start + n)


def test_prune_layer_keeps_budget_and_drops_the_rest():
    torch.manual_seed(0)
    Hq, Hkv, D, bs, P, N = 4, 2, 8, 4, 40, 47
    dense = Attention(Hq, Hkv, D, D ** -0.5)
    dense.k_cache = torch.zeros(16, bs, Hkv, D)
    dense.v_cache = torch.zeros(16, bs, Hkv, D)
    table = torch.randperm(16)[:12].int()
    layer = PruneAttention(dense, sinks=2, top_k=5, recent=4, pool=3)
    layer.arm(P, window=3)
    q, k, v = torch.randn(N, Hq, D), torch.randn(N, Hkv, D), torch.randn(N, Hkv, D)
    # prefill in two chunks, the observation window straddling them
    for a, b in ((0, 38), (38, 40)):
        set_context(_ctx(a, b - a, table, bs))
        layer(q[a:b], k[a:b], v[a:b])
    keep = layer.keep
    assert keep.shape == (Hkv, P) and keep.sum(1).tolist() == [2 + 5 + 4] * Hkv
    assert keep[:, :2].all() and keep[:, -4:].all()
    ref_scores = snapkv_scores(q[37:40], torch.arange(37, 40), k[:40], D ** -0.5)
    assert torch.equal(keep, select_keep(ref_scores, 2, 5, 4, pool=3))
    # brute force: softmax weights from the window queries, summed over group heads and queries
    s = torch.einsum("whgd,khd->hgwk", q[37:40].view(3, Hkv, 2, D), k[:40]) * D ** -0.5
    s = s.masked_fill(torch.arange(40)[None, :] > torch.arange(37, 40)[:, None], float("-inf"))
    torch.testing.assert_close(ref_scores, s.softmax(-1).sum((1, 2)))

    # queries past the prune point see kept prompt tokens + everything from P on, causally
    set_context(_ctx(P, N - P, table, bs))
    out = layer(q[P:], k[P:], v[P:])
    allow = torch.cat([keep, torch.ones(Hkv, N - P, dtype=torch.bool)], 1)
    causal = torch.arange(N)[None, :] <= torch.arange(P, N)[:, None]
    sc = torch.einsum("qhgd,khd->hgqk", q[P:].view(-1, Hkv, 2, D), k) * D ** -0.5
    sc = sc.masked_fill(~(allow[:, None, None, :] & causal[None, None]), float("-inf"))
    ref = torch.einsum("hgqk,khd->qhgd", sc.softmax(-1), v).reshape(N - P, Hq, D)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # a dropped prompt token no longer matters; a kept one does
    dropped = int((~keep[0] & ~keep[1]).nonzero()[0])
    kept = int((keep[0] & keep[1]).nonzero()[-1])
    flat_v = layer.v_cache.view(-1, Hkv, D)
    for pos, changes in ((dropped, False), (kept, True)):
        slot = int(table[pos // bs]) * bs + pos % bs
        saved = flat_v[slot].clone()
        flat_v[slot] += 5.0
        set_context(_ctx(N - 1, 1, table, bs))
        o2 = layer(q[N - 1:], k[N - 1:], v[N - 1:])
        flat_v[slot] = saved
        assert (not torch.allclose(o2, out[-1:], atol=1e-6)) == changes
    set_context(None)


def test_prune_engine_full_budget_is_dense_and_small_budget_is_not(setup):
    """Through the engine, over two turns sharing the prefix cache: a budget covering the prompt gives the dense
    log-probs; a small one changes them and keeps exactly sinks + top-k + recent per KV head."""
    from sketchkv import LLM, SamplingParams
    from sketchkv.eval.prune import install_prune
    path, _, _ = setup
    g = torch.Generator().manual_seed(3)
    doc = torch.randint(3, 500, (700,), generator=g).tolist()
    q1, q2 = [7, 8, 9, 10], [11, 12, 13]
    cont1 = torch.randint(3, 500, (6,), generator=g).tolist()
    cont2 = torch.randint(3, 500, (6,), generator=g).tolist()

    def run(budget):
        llm = LLM(path, device="cpu", block_size=16, enforce_eager=True)
        layers = install_prune(llm, *budget) if budget else []
        for layer in layers:
            layer.arm(len(doc) + len(q1), len(q1))
        llm.generate(prompt_token_ids=[doc + q1], sampling_params=SamplingParams(temperature=0, max_tokens=2))
        rows = llm.teacher_force([doc + q1 + cont1 + q2], [cont2])[0]   # turn 2: the whole conversation re-sent
        assert llm.engine.scheduler.prefix_hits >= len(doc)  # ... and served from the prefix cache
        return rows, layers

    dense, _ = run(None)
    full, layers = run((4, 4096, 16))
    assert layers and all(bool(layer.keep.all()) for layer in layers)
    assert (full - dense).abs().max() < 1e-4
    small, layers = run((4, 16, 16))
    assert all(layer.keep.sum(1).tolist() == [4 + 16 + 16] * layer.num_kv_heads for layer in layers)
    assert (small - dense).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------------
# Regression gate on the reference model (activates once sketchkv/assets/reference-model ships)
# ----------------------------------------------------------------------------------------------------------
REF = default_model()
ref_absent = not (os.path.isfile(os.path.join(REF, "config.json"))
                  and os.path.isfile(os.path.join(REF, "key_basis.safetensors")))
# Bound: sinks 16 + top-64 + recent 128 per step (5-10% of a 2K-4K context), teacher-forced over held-out code.
GATE = "gate:sparse=true,top_k=64,sink_tokens=16,recent_tokens=128,dense_threshold=0"
# Bounds from the first run on the shipped model (CPU, 2026-11-29): top-1 0.9375 (95% CI +-0.06 over 4 x 64
# tokens), mean KL 0.094 nats (heavy tail: p50 0.003, max 5.5), lookups lost vs dense 1 of 4. Meant to catch a broken
# selection, not a few-percent drift (that is what `sketchkv eval` measures).
GATE_TOP1, GATE_KL, GATE_LOST = 0.85, 0.25, 2
# The same over the int4 host tier with 512-token prompt chunks, so that the default prefill selection over the
# tier (auto = one selection per chunk) runs on every chunk after the first. CPU, 2026-12-02: top-1 0.945, KL 0.018
# (the gate above: 0.961, 0.011). Same bounds.
GATE_TIER = ("gate-tier:sparse=true,top_k=64,sink_tokens=16,recent_tokens=128,dense_threshold=0,host_tier=true,"
             "max_num_batched_tokens=512")


def _smallest_heldout_package():
    info = json.load(open(os.path.join(REF, "heldout.json")))
    import sysconfig
    roots = [info.get("corpus_root"), sysconfig.get_paths()["purelib"]]
    sizes = info.get("per_package", {})
    for pkg in sorted(info.get("packages", []), key=lambda p: sizes.get(p, {}).get("bytes", 1 << 40)):
        for r in roots:
            if r and os.path.isdir(os.path.join(r, pkg)):
                return os.path.join(r, pkg)
    pytest.skip("no held-out package of the reference model found on this machine")


@pytest.mark.slow
@pytest.mark.skipif(ref_absent, reason="the reference model (issue 3) is not in sketchkv/assets yet")
def test_reference_model_sparse_quality_gate(tmp_path):
    from sketchkv.eval.kld import run_kld
    from sketchkv.eval.recall import run_recall
    data = [_smallest_heldout_package()]
    r = run_kld(REF, data, [2048, 4096], continuation=64, samples=2, candidates=[GATE, GATE_TIER], floors=["none"],
                out_dir=str(tmp_path), base={"device": "cpu"}, quiet=True)
    for name in ("gate", "gate-tier"):
        o = r["configs"][name]["overall"]
        assert o["top1"] >= GATE_TOP1, f"{name}: top-1 agreement regressed: {o['top1']:.4f} < {GATE_TOP1}"
        assert o["kl_mean"] <= GATE_KL, f"{name}: KL regressed: {o['kl_mean']:.4f} > {GATE_KL} nats/token"
    rec = run_recall(REF, data, [2048], samples=4, kinds=["lookup"], candidates=[GATE], out_dir=str(tmp_path),
                     base={"device": "cpu"}, quiet=True)
    dense = rec["configs"]["dense"]["by_length"]["2048"]["lookup"]
    sparse = rec["configs"]["gate"]["by_length"]["2048"]["lookup"]
    assert sparse["lost_vs_dense"] <= GATE_LOST, f"sparse lost {sparse['lost_vs_dense']} of dense's lookups ({dense})"


def test_sweep_end_to_end_one_prefill_many_selections(setup):
    """eval.sweep: the selection configurations replay over one cached prefill (the rank-8 sketch re-made from the
    cached keys), each scored against the dense reference of the same engine; with k >= context the sparse path is
    the dense result; the floor, host-tier and prune engines prefill their own copies."""
    from sketchkv.eval import sweep
    path, data, root = setup
    out = str(root / "sweep")
    r = sweep.main([data, "--model", path, "--basis", f"8={os.path.join(path, 'key_basis.safetensors')}",
                    "--lengths", "512", "--samples", "1", "--continuation", "8", "--k-fracs", "0.0625", "4",
                    "--sinks", "4", "--recent", "16", "--tier-formats", "int8", "--tier-rank", "8", "--miss-estimate",
                    "--only", r"^(floor:chunk|(oracle|sketch8)-shared-k\d+|sketch8-kvhead-k32|prune-snapkv-k32|"
                              r"tier-int8-r8-k\d+)$", "--out-dir", out])
    for ext in ("json", "md", "png"):
        assert os.path.getsize(os.path.join(out, f"sweep.{ext}")) > 0
    cfg = {n: e["by_length"]["512"] for n, e in r["configs"].items()}
    assert set(cfg) == {"floor:chunk", "oracle-shared-k32", "oracle-shared-k2048", "sketch8-shared-k32",
                        "sketch8-shared-k2048", "sketch8-kvhead-k32", "prune-snapkv-k32", "tier-int8-r8-k2048"}
    assert r["partial"] is False
    for n in ("floor:chunk", "oracle-shared-k2048", "sketch8-shared-k2048"):
        assert cfg[n]["kl_mean"] < 1e-6 and cfg[n]["top1"] == 1.0, n
    assert cfg["sketch8-shared-k32"]["kl_mean"] > 1e-6           # 52 of ~516 tokens read: not dense
    assert cfg["tier-int8-r8-k2048"]["kl_mean"] < 0.05           # int8 rows, every token
    assert 0 < cfg["sketch8-shared-k32"]["frac_read"] < 0.2 and cfg["floor:chunk"]["frac_read"] == 1.0
    est = r["configs"]["sketch8-shared-k32"]["miss_estimate"]["512-0"]
    assert 0 < est["mean"] <= 1 and len(est["per_layer_mean"]) == 2
    assert r["configs"]["sketch8-shared-k2048"]["miss_estimate"]["512-0"]["mean"] < 1e-6   # nothing left out
    # adaptive k per layer from those estimates, at equal rows: each layer's k recorded, their mean the k
    r = sweep.main([data, "--model", path, "--basis", f"8={os.path.join(path, 'key_basis.safetensors')}",
                    "--lengths", "512", "--samples", "1", "--continuation", "8", "--k-fracs", "0.0625", "--sinks", "4",
                    "--recent", "16", "--tier-formats",
                    "--layer-k", os.path.join(out, "sweep.json") + ":sketch8-shared-k32",
                    "--only", r"^sketch8-shared-k32\+lk$", "--out-dir", out, "--name", "lk"])
    e = r["configs"]["sketch8-shared-k32+lk"]
    assert sum(e["layer_k"]) == 2 * 32 and e["by_length"]["512"]["kl_mean"] > 1e-6


def test_layer_k_keeps_the_total_and_follows_the_weights():
    from sketchkv.eval.sweep import layer_k
    ks = layer_k(128, [0.8, 0.2, 0.4, 0.4, 0.05])
    assert sum(ks) == 5 * 128 and ks[0] > ks[2] == ks[3] > ks[1] > ks[4] >= 32
    assert layer_k(64, [0.3] * 4) == [64] * 4
