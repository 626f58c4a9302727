"""The MTP drafter's attention over a window of its context: the first `sinks` tokens and the last `window`
(EngineConfig.mtp_attention_window > 0; 0 keeps the trained dense attention).

The drafter's one attention layer reads its whole KV on every draft step: at 8 x 250K agents of the 27B
shape that is 8 GB per draft step, 7 steps per verification step (~14 ms of H200 run 35's 76 ms). Drafts
only propose: the verification decides every token, so a narrower drafter changes the acceptance rate,
never the output. Decode rows only (drafting and the catch-up after verification); prompt chunks keep
the dense prefill path. The KV stays paged in the model's blocks (same slots), so memory is unchanged.
"""
import torch

from sketchkv.layers.attention import Attention
from sketchkv.ops.selection import compose_selection
from sketchkv.ops.sparse_attention import sparse_attention


class WindowedAttention(Attention):
    def __init__(self, dense: Attention, sinks: int, window: int):
        super().__init__(dense.num_heads, dense.num_kv_heads, dense.head_dim, dense.scale)
        self.sinks, self.window = sinks, window

    def decode(self, q, block_tables, seq_lens, sparse: bool, graph: bool, max_seq_len: int) -> torch.Tensor:
        no_picks = torch.empty(q.shape[0], 1, 0, dtype=torch.int32, device=q.device)
        idx, counts = compose_selection(no_picks, seq_lens, seq_lens, self.sinks, self.window)
        return sparse_attention(q, self.k_cache, self.v_cache, block_tables, idx, counts, self.scale)
