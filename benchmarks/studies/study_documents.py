"""The setting the int4 host-row studies share: two held-out documents of the reference model, each an N-token
prompt and 128 teacher-forced tokens, and the sparse engine options they compare formats under (CPU)."""
from sketchkv.config import default_model
from sketchkv.eval.common import heldout_token_ids

FORCED = 128


def held_out_documents(n: int) -> tuple[list[list[int]], list[list[int]], dict]:
    """(prompts, continuations, LLM options) for prompts of n tokens."""
    C = FORCED
    ids = heldout_token_ids(default_model(), 2 * (n + C))
    prompts = [ids[:n], ids[n + C:2 * n + C]]
    conts = [ids[n:n + C], ids[2 * n + C:2 * n + 2 * C]]
    opts = dict(device="cpu", block_size=16, max_num_seqs=2, max_num_batched_tokens=4096, sparse=True,
                sparse_top_k=max(128, n // 64), sparse_sink_tokens=64, sparse_recent_tokens=256,
                sparse_dense_threshold=0)
    return prompts, conts, opts
