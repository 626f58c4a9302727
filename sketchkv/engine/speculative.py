"""MTP speculative decoding: draft n tokens with the checkpoint's MTP layer, verify them in one step.

One engine step with speculation on (`num_speculative_tokens` = n > 0):

1. propose: every running sequence the scheduler gave 1 + k tokens (k <= n drafts) gets k drafts
   from the drafter. The MTP drafter starts from its output at the sequence's last computed token
   (kept from the previous step) and runs its one attention layer k - 1 more times, one position
   per call, feeding back its own hidden state and the draft token (vLLM's MTP proposer).
2. verify: the target runs the last token + k drafts as k + 1 rows of that sequence. Attention
   layers treat each row as a decode row with its own length (causal over the cache; sparse layers
   select per position, or once per sequence with verify_selection=shared: then the decode kernel reads a
   sequence's rows once for all of them); Gated DeltaNet layers step through the rows without writing
   the sequences' states (all positions in one recurrence call when every sequence has 1 + n rows) and
   keep the step's inputs (`GatedDeltaNet.forward_verify`). `rejection_sampler.verify` keeps a prefix of
   the drafts and adds one token.
3. commit: each sequence's GDN state advances through its kept rows again, from its slot and the
   kept inputs (`GatedDeltaNet.replay_verified`: the verification's conv and recurrence kernels again, up to
   each kept position, so bitwise the state the verification computed, and no per-position states in
   memory); the scheduler counts only accepted
   rows as cached and frees the blocks that only rejected rows used. KV rows of rejected positions
   stay in kept blocks and are overwritten later (attention never reads past a sequence's length).
4. catch up: the MTP layer runs over the step's accepted rows (prompt chunks too), on the target's
   hidden states and the next tokens, writing its KV cache and leaving its output at the last row
   for the next step's first draft.

The dense drafter's KV cache (mtp_attention_window=0) is paged in the model's blocks (same block tables and
slots: one more attention layer per block), so sharing, preemption and rollback need no extra bookkeeping;
the windowed drafter (the default) keeps sinks + a ring of its recent K/V per state slot
(layers/windowed_attention.py), saved and restored with the GDN state by the prefix cache.
Steady-state verification steps (every sequence: its token + exactly n drafts; up to
VERIFY_GRAPH_MAX_ROWS rows) replay a CUDA graph of bucket x (1 + n) rows (ModelRunner._replay_verify;
emulated on CPU in tests, GPU-tested on an H200); other verification steps run eagerly; pure decode
steps (no drafts) replay the decode graphs. The commit's GDN replay after a step whose inputs sit in the
static buffers replays one graph per bucket (ModelRunner.replay_commit, all 1 + n positions; H200 run 32),
step by step and eagerly when a prefix-cache snapshot falls inside the verified run. Greedy
drafting of n tokens for every sequence replays one drafter graph per step (MTPDrafter.capture_graphs;
one host sync for the drafts); sampled drafting and steps with fewer drafts run eagerly. The catch-up
after a graph verification step replays a graph over all 1 + n rows of each sequence
(MTPDrafter.capture_catch_up_graphs); after other steps it is one eager MTP pass over the accepted rows
(prompt chunks too), attended as decode rows. Verification graphs exist per length bucket, as decode graphs.
"""

import numpy as np
import torch

from sketchkv.engine.context import Context, VerifyRows, decode_rows, forward_context
from sketchkv.engine.graph_inputs import copy_event, host_views, send, staged, write_tables
from sketchkv.engine.sequence import Sequence, Status, block_tables
from sketchkv.errors import CheckpointError
from sketchkv.layers.attention import Attention
from sketchkv.layers.rejection_sampler import VerifyOutput, verify
from sketchkv.layers.sampler import _filter


def verify_rows(query_lens: list[int], cu: list[int], state_slots: list[int], decoding: list[bool],
                device) -> VerifyRows:
    """Row and slot lists for `GatedDeltaNet.forward_verify`. A regular step (every sequence decodes with the same
    number of rows) needs only the sequences' slots: its layers step all positions at once."""
    t = lambda x, dt=torch.int64: to_device(x, dt, device)
    other = [b for b, d in enumerate(decoding) if not d]
    if not other and len(set(query_lens)) == 1:
        return VerifyRows([(None, t(state_slots), None)], regular=query_lens[0])
    dec = [b for b, d in enumerate(decoding) if d]
    steps = []
    for pos in range(max(query_lens[b] for b in dec)):
        live = [i for i, b in enumerate(dec) if query_lens[b] > pos]
        steps.append((t([cu[dec[i]] + pos for i in live]), t([state_slots[dec[i]] for i in live]), t(live)))
    vr = VerifyRows(steps)
    if other:
        vr.other_rows = t([r for b in other for r in range(cu[b], cu[b + 1])])
        vr.other_slots = t([state_slots[b] for b in other])
        vr.other_cu = t([0] + [sum(query_lens[b] for b in other[:i + 1]) for i in range(len(other))], torch.int32)
    return vr


def draw(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """One draft token per row (a device tensor: no host sync) and the distribution it was drawn from
    (None for greedy requests, which draft the argmax)."""
    logits = logits.float()
    toks = torch.argmax(logits, -1)
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    for i, s in enumerate(seqs):
        if not s.params.greedy:
            probs[i] = torch.softmax(_filter(logits[i], s.params), -1)
            toks[i] = torch.multinomial(probs[i], 1, generator=s.generator)[0]
    return toks, probs


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list as a device tensor without waiting for the GPU: from pinned memory, asynchronously
    (torch.tensor(..., device=cuda) copies from pageable memory, which synchronises the stream)."""
    x = torch.tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return x.to(device)
    # a capture would record a read of this transient host buffer into the graph
    assert not torch.cuda.is_current_stream_capturing(), "to_device inside a CUDA-graph capture"
    return x.pin_memory().to(device, non_blocking=True)


class MTPDrafter:
    """Drafts with the model's `mtp` module; its attention layers' KV caches are bound by the runner."""

    def __init__(self, runner):
        self.runner = runner
        self.model = runner.model
        if getattr(self.model, "mtp", None) is None:
            raise CheckpointError("num_speculative_tokens > 0 needs a checkpoint with an MTP layer (mtp.* tensors, "
                                  "mtp_num_hidden_layers in config.json)")
        self.graphs = {}   # batch bucket -> CUDA graph drafting n greedy tokens for that many sequences
        # (batch bucket, blocks per row; None for the windowed drafter) -> the catch-up after a graph verification
        self.catch_up_graphs = {}

    # ---- CUDA graphs: all n drafts of greedy sequences in one replay ------------------------------------
    # Eager, a step's drafting is n LM-head projections and n - 1 MTP passes, each a few dozen small
    # kernels: on a small model it costs more than the graphed verification (H200 run 18: speculation 6-8x
    # slower than plain decoding on the reference model). Captured per batch bucket over static buffers:
    # the MTP rows' positions, slots and lengths are computed on the device from the first position and
    # the block tables, so one replay drafts all n positions; padded rows write the scratch block. The integer
    # inputs are staged on the host as the runner's (graph_inputs.staged): two copies.
    def capture_graphs(self, sizes: list[int], pool):
        r, n = self.runner, self.runner.num_spec
        B, dev = max(sizes), r.device
        self.g_hidden = torch.zeros(B, r.model_cfg.hidden_size, dtype=r.dtype, device=dev)
        # the first MTP pass's row's position, the state slot (the windowed drafter's rings are per slot)
        self.g_pad = np.array([[0], [r.scratch_slot]], dtype=np.int64)
        self.h_int64, self.g_int64 = staged((2, B), torch.int64, dev, self.g_pad)
        self.g_pos, self.g_slots = self.g_int64
        self.h_tables, self.g_tables = staged((B, r.max_blocks_per_seq), torch.int32, dev)
        self.copied = copy_event(dev)
        self.g_drafts = torch.zeros(B, n, dtype=torch.int64, device=dev)
        self.g_cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
        for bs in reversed(sizes):
            self.graphs[bs], pool = r._capture(self._graph_context(bs, self.g_pos[:bs]), lambda bs=bs: self._draft_all(bs), pool)
        return pool

    def _graph_context(self, bs: int, pos: torch.Tensor) -> Context:
        r = self.runner
        tables = self.g_tables[:bs]
        blk = tables.gather(1, torch.div(pos, r.block_size, rounding_mode="floor")[:, None].to(torch.int64))[:, 0]
        return Context(cu_seqlens_q=self.g_cu[:bs + 1], seq_lens=(pos + 1).to(torch.int32),
                       slot_mapping=blk.to(torch.int64) * r.block_size + pos % r.block_size, block_tables=tables,
                       state_slots=self.g_slots[:bs], query_lens=[1] * bs, context_lens=[1] * bs, is_decode=True,
                       max_seq_len=r.max_model_len, graph=True)

    def _draft_all(self, bs: int) -> None:
        """The captured step: greedy drafts 1..n of `bs` sequences from g_hidden, as `propose` drafts them."""
        h = self.g_hidden[:bs]
        tok = torch.argmax(self.model.compute_logits(h).float(), -1)
        self.g_drafts[:bs, 0] = tok
        for j in range(1, self.g_drafts.shape[1]):
            pos = self.g_pos[:bs] + (j - 1)
            h = self._mtp(tok, h, pos, self._graph_context(bs, pos))
            tok = torch.argmax(self.model.compute_logits(h).float(), -1)
            self.g_drafts[:bs, j] = tok

    def _graph_bucket(self, seqs: list[Sequence], ks: list[int]) -> int | None:
        if not self.graphs or any(k != self.g_drafts.shape[1] for k in ks) or not all(s.params.greedy for s in seqs):
            return None
        return min((b for b in self.graphs if b >= len(seqs)), default=None)

    def _replay(self, seqs: list[Sequence], bucket: int) -> None:
        B = len(seqs)
        h, tables = host_views(self.copied, self.h_int64, self.h_tables)
        h[:, :B] = [s.num_cached for s in seqs], [s.state_slot for s in seqs]
        h[:, B:bucket] = self.g_pad
        write_tables(tables[:bucket, None], seqs)
        send([(self.g_int64, self.h_int64), (self.g_tables[:bucket], self.h_tables[:bucket])], self.copied)
        with torch.no_grad():   # (out= refuses inputs with autograd history: eager MTP passes run outside inference mode)
            torch.stack([s.mtp_hidden for s in seqs], out=self.g_hidden[:B])
        if B < bucket:
            self.g_hidden[B:bucket].zero_()
        self.graphs[bucket].replay()
        for s, d in zip(seqs, self.g_drafts[:B].tolist()):   # the step's one host sync
            s.draft_token_ids, s.draft_probs = d, None

    # ---- CUDA graphs: the catch-up after a graph verification step ---------------------------------------
    # Eager, the catch-up was ~2.3 ms of an 11.8 ms MTP-7 step at 8 x 128K on the reference model (H200
    # run 63: dozens of small launches). After a verification graph the step's rows sit in the runner's
    # static buffers (target hidden states v_out, positions, lengths, slots, tables), so one graph per bucket
    # runs the MTP layer over all 1 + n rows of every sequence, each attended as a decode row of its own
    # length (as the eager pass attends its rows). Rows past a sequence's accepted ones get a filler token:
    # the K/V they write lie past its length, and the next step's drafter and catch-up overwrite them before
    # any row reads them (ring >= W + n + 1 rows; paged: attention never reads past a row's length).
    def capture_catch_up_graphs(self, contexts: dict[tuple[int, int], Context], pool):
        """contexts: the verification graphs' (batch bucket, blocks per row) -> context. The windowed drafter
        reads its ring, not the block tables: one graph per batch bucket serves every length."""
        r, Q = self.runner, self.runner.num_spec + 1
        paged, full = bool(r.mtp_paged_layers), max(nb for _, nb in contexts)
        R = max(bs for bs, _ in contexts) * Q
        # staged (graph_inputs.staged): the rows' next tokens (the graph's input), then the sequences' last
        # accepted rows (to read their outputs)
        self.hc_int64, self.c_int64 = staged((R + R // Q,), torch.int64, r.device)
        self.c_ids, self.c_last = self.c_int64[:R], self.c_int64[R:]
        self.c_copied = copy_event(r.device)
        self.c_out = torch.zeros(R, r.model_cfg.hidden_size, dtype=r.dtype, device=r.device)
        for (bs, nb), ctx in sorted(contexts.items(), reverse=True):
            if paged or nb == full:
                step = lambda n=bs * Q: self.c_out[:n].copy_(
                    self.model.mtp(self.model.model.embed_tokens(self.c_ids[:n]), r.v_out[:n], r.v_pos[:n]))
                self.catch_up_graphs[(bs, nb if paged else None)], pool = r._capture(ctx, step, pool)
        return pool

    def _catch_up_graph(self, items: list[tuple[Sequence, int, int, int]]) -> bool:
        """The catch-up from its graph when the step verified in a graph (every item: a decoding sequence's
        accepted rows, at the start of its 1 + n rows); False: catch up eagerly."""
        r, Q = self.runner, self.runner.num_spec + 1
        if r.verify_graph_bucket is None:
            return False
        bucket, nb = r.verify_graph_bucket
        key = (bucket, nb if r.mtp_paged_layers else None)
        if key not in self.catch_up_graphs or len(items) > bucket \
                or any(r0 != i * Q or not 0 < n <= Q for i, (_, _, n, r0) in enumerate(items)):
            return False
        h, = host_views(self.c_copied, self.hc_int64)
        R = len(self.c_ids)
        h[:bucket * Q] = 0   # the filler token
        for i, (seq, s, n, _) in enumerate(items):
            h[i * Q:i * Q + n] = seq.token_ids[s + 1:s + n + 1]
        h[R:R + len(items)] = [i * Q + n - 1 for i, (_, _, n, _) in enumerate(items)]
        send([(self.c_int64, self.hc_int64)], self.c_copied)
        self.catch_up_graphs[key].replay()
        last = self.c_out[self.c_last[:len(items)]]
        for i, (seq, s, n, _) in enumerate(items):
            if seq.status == Status.RUNNING and s + n == len(seq) - 1:
                seq.mtp_hidden = last[i]
                seq.spec_ready = True
        return True

    def _mtp(self, ids, hidden, positions, ctx):
        with forward_context(ctx):
            return self.model.mtp(self.model.model.embed_tokens(ids), hidden, positions)

    def catch_up(self, items: list[tuple[Sequence, int, int, int]], hidden: torch.Tensor) -> None:
        """items: (sequence, first position, number of rows, first row in `hidden`), the rows the
        target just computed and kept. Writes the MTP KV of those positions; for sequences with one
        token pending, keeps the MTP output at the last row for the next drafts."""
        if self._catch_up_graph(items):
            return
        items = [it for it in items if it[2] > 0]
        if not items:
            return
        dev = hidden.device
        rows = to_device([r for _, _, n, r0 in items for r in range(r0, r0 + n)], torch.int64, dev)
        ids = to_device([tok for seq, s, n, _ in items for tok in seq.token_ids[s + 1:s + n + 1]], torch.int64, dev)
        positions = to_device([p for _, s, n, _ in items for p in range(s, s + n)], torch.int64, dev)
        ctx = rows_context(self.runner, [(seq, s, n) for seq, s, n, _ in items], self.runner.num_spec + 1)
        out = self._mtp(ids, hidden[rows], positions, ctx)
        end = 0
        for seq, s, n, _ in items:
            end += n
            if seq.status == Status.RUNNING and s + n == len(seq) - 1:
                seq.mtp_hidden = out[end - 1]
                seq.spec_ready = True

    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Sets seq.draft_token_ids (ks[i] tokens) and seq.draft_probs for each sequence. The drafts stay on
        the device until the last position (one host sync per step, not one per draft position)."""
        bucket = self._graph_bucket(seqs, ks)
        if bucket is not None:
            return self._replay(seqs, bucket)
        dev = self.runner.device
        B = len(seqs)
        h = torch.stack([s.mtp_hidden for s in seqs])
        tok, probs = draw(self.model.compute_logits(h), seqs)
        drafts = torch.zeros(B, max(ks), dtype=torch.int64, device=dev)   # [sequence, draft position]
        drafts[:, 0] = tok
        dprobs = [[p] for p in probs]
        for j in range(1, max(ks)):  # draft j + 1: MTP row at the position of draft j - 1's successor
            live = [i for i, k in enumerate(ks) if k > j]
            items = [(seqs[i], seqs[i].num_cached + j - 1, 1) for i in live]
            idx = torch.arange(B, device=dev) if len(live) == B else to_device(live, torch.int64, dev)
            out = self._mtp(drafts[idx, j - 1], h[idx], to_device([s for _, s, _ in items], torch.int64, dev),
                            rows_context(self.runner, items))
            h = h.clone()
            h[idx] = out
            tok, probs = draw(self.model.compute_logits(out), [seqs[i] for i in live])
            drafts[idx, j] = tok
            for i, p in zip(live, probs):
                dprobs[i].append(p)
        for s, d, p, k in zip(seqs, drafts.tolist(), dprobs, ks):
            s.draft_token_ids = d[:k]
            s.draft_probs = None if s.params.greedy else torch.stack(p[:k])


def rows_context(runner, items: list[tuple[Sequence, int, int]], decode_rows_max: int = 1) -> Context:
    """Forward context for `n` rows of each sequence starting at position `start` (the drafter's
    passes: same blocks and slots as the target's rows at those positions). A sequence with a cached
    prefix and at most `decode_rows_max` rows (a catch-up after verification) has each row attended as
    a decode row of its own length, like verification rows: a prompt-style pass would gather its whole
    cached K/V for a few queries (1 GB per 250K-token sequence of the 27B shape)."""
    bs, dev = runner.block_size, runner.device
    t = lambda x, dt: to_device(x, dt, dev)
    slots, cu = [], [0]
    for seq, start, n in items:
        slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
        cu.append(cu[-1] + n)
    qlens, cached = [n for _, _, n in items], [s for _, s, _ in items]
    ctx = Context(cu_seqlens_q=t(cu, torch.int32), seq_lens=t([s + n for s, n in zip(cached, qlens)], torch.int32),
                  slot_mapping=t(slots, torch.int64),
                  block_tables=block_tables([seq for seq, _, _ in items]).to(dev),
                  state_slots=t([seq.state_slot for seq, _, _ in items], torch.int64), query_lens=qlens,
                  context_lens=cached, is_decode=all(n == 1 and c > 0 for n, c in zip(qlens, cached)),
                  max_seq_len=max(c + n for c, n in zip(cached, qlens)))
    # rows after the first count as drafts for ctx.decodes(): every row of the sequence is a decode row
    ctx.num_drafts = [n - 1 if c > 0 and n <= decode_rows_max else 0 for c, n in zip(cached, qlens)]
    dec = [b for b in range(len(items)) if ctx.decodes(b)]
    if dec and not ctx.is_decode:
        ctx.decode_rows = t([cu[b] + i for b in dec for i in range(qlens[b])], torch.int64)
        ctx.decode_seqs = t([b for b in dec for _ in range(qlens[b])], torch.int64)
        ctx.decode_lens = t([cached[b] + i + 1 for b in dec for i in range(qlens[b])], torch.int32)
        ctx.decode_max_len = max(cached[b] + qlens[b] for b in dec)
    return ctx


class Speculator:
    """The runner's speculative-decoding state: drafter, verification, rollback, metrics."""

    def __init__(self, runner, num_tokens: int):
        self.runner, self.num_tokens = runner, num_tokens
        self.drafter = MTPDrafter(runner)
        self._hidden, self._row0 = None, []
        self.reset_metrics()

    def reset_metrics(self) -> None:
        self.num_verified = 0                       # (sequence, step) pairs with >= 1 draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.drafted_at = [0] * self.num_tokens     # verifications with a draft at position i
        self.accepted_at = [0] * self.num_tokens    # ... that accepted it

    # ---- memory --------------------------------------------------------------------------------
    @staticmethod
    def mtp_layers(model) -> list[Attention]:
        mtp = getattr(model, "mtp", None)
        return [m for m in mtp.modules() if isinstance(m, Attention)] if mtp is not None else []

    def bytes_per_seq(self, context_len: int) -> dict:
        """Extra device memory one sequence (agent) costs with speculation on, at `context_len` tokens."""
        r, c = self.runner, self.runner.model_cfg
        paged = 2 * len(r.mtp_paged_layers) * c.num_kv_heads * c.head_dim * r.dtype.itemsize * context_len
        mtp_kv = paged + sum(m.ring_bytes(r.dtype) for m in r.mtp_ring_layers)   # the windowed drafter: its ring
        # no per-position GDN states (replayed from the step's inputs): the engine's input buffers, per sequence
        inputs = sum(m.verify_buffer_bytes() for m in r.gdn_layers) / r.cfg.scheduler.max_num_seqs
        return {"mtp_kv": mtp_kv, "gdn_verify_inputs": inputs, "total": mtp_kv + inputs}

    # ---- one step ------------------------------------------------------------------------------
    def propose(self, batch: list[tuple[Sequence, int]]) -> None:
        todo = [(seq, seq.num_drafts(n)) for seq, n in batch if seq.num_drafts(n) > 0]
        if todo:
            self.drafter.propose([s for s, _ in todo], [k for _, k in todo])

    def verify(self, batch: list[tuple[Sequence, int]], hidden: torch.Tensor) -> VerifyOutput:
        """Target hidden states of the step -> tokens for each sequence that completed its tokens."""
        self._hidden, self._row0 = hidden, []
        rows, spans, done = [], [], []
        self._decoding = {}    # seq_id -> first row, for the GDN replay in commit (the rows forward_verify stepped)
        # forward_verify runs only in a step with drafts (the runner sets ctx.verify then); in a step without
        # any, the GDN layers advanced the slots in place and there is nothing to replay
        verifying = any(seq.num_drafts(n) for seq, n in batch)
        end = 0
        for seq, n in batch:
            self._row0.append(end)
            k = seq.num_drafts(n)
            if verifying and decode_rows(seq.num_cached, n, k):   # as Context.decodes: the rows forward_verify stepped
                self._decoding[seq.seq_id] = end
            end += n
            if seq.num_cached + n - k == len(seq):
                spans.append((len(rows), k + 1))
                rows += range(end - k - 1, end)
                done.append(seq)
        self._rows_total = end
        if not done:
            return VerifyOutput([], [], [], [], [])
        logits = self.runner.model.compute_logits(hidden[to_device(rows, torch.int64, hidden.device)])
        return verify(logits, spans, [s.draft_token_ids for s in done],
                      [s.draft_probs for s in done], [s.params for s in done], [s.generator for s in done])

    def commit(self, done: list[Sequence], out: VerifyOutput, snapshots: set[tuple[int, int]] = frozenset()) -> None:
        """Advance each decoding sequence's GDN state to its last kept position (the verification ran on
        copies: GatedDeltaNet.replay_verified); count. snapshots {(state slot, t)}: states after position t
        to keep for `slot_states` (prefix-cache snapshot points inside the verified run)."""
        rows0, slots, acc = [], [], []
        for seq, k, a in zip(done, out.num_drafts, out.num_accepted):
            if seq.seq_id in self._decoding:
                rows0.append(self._decoding[seq.seq_id])
                slots.append(seq.state_slot)
                acc.append(a)
            if k == 0:
                continue
            self.num_verified += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += a
            for i in range(k):
                self.drafted_at[i] += 1
                self.accepted_at[i] += i < a
        if slots:
            # snapshot points need copies taken mid-replay: eager
            if not snapshots and self.runner.replay_commit(rows0, slots, acc, self._rows_total):
                return
            rows0_t, slots_t, acc_t = to_device([rows0, slots, acc], torch.int64, self.runner.device)
            snaps: dict[int, list[int]] = {}
            for slot, pos in snapshots:
                snaps.setdefault(pos, []).append(slot)
            for m in self.runner.gdn_layers:
                m.replay_verified(rows0_t, slots_t, acc_t, max(acc) + 1, self._rows_total, self.runner.scratch_slot,
                                  snaps)

    def catch_up(self, batch: list[tuple[Sequence, int]], starts: list[int]) -> None:
        """After the scheduler advanced num_cached: the drafter sees the step's kept rows."""
        items = [(seq, s, seq.num_cached - s, r0) for (seq, _), s, r0 in zip(batch, starts, self._row0)]
        self.drafter.catch_up(items, self._hidden)
        for seq, _ in batch:
            seq.draft_token_ids, seq.draft_probs = [], None
        self._hidden = None

    def slot_states(self, slot: int, t: int) -> list[torch.Tensor]:
        """Like ModelRunner.slot_states, for the state after verified position t of this step (asked for in
        commit's snapshots). The drafter's K/V ring is taken as it is after the step's catch-up: it holds the
        window of position t too (its ring has room for the n rows past t)."""
        return [x for m in self.runner.gdn_layers for x in m.snapshots[(slot, t)]] + self.runner.extra_slot_states(slot)

    def metrics(self) -> dict:
        """Mean accepted length = tokens emitted per verification (accepted drafts + the target's one)."""
        v = self.num_verified
        return {"num_speculative_tokens": self.num_tokens, "spec_verifications": v,
                "spec_draft_tokens": self.num_draft_tokens, "spec_accepted_tokens": self.num_accepted_tokens,
                "spec_mean_accepted_length": (self.num_accepted_tokens + v) / v if v else 0.0,
                "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
                "spec_acceptance_by_position": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]}
