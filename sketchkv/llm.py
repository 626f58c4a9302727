"""The Python API, in vLLM's shape: LLM(model=DIR).generate(prompts, SamplingParams(...))."""
from tqdm import tqdm

from sketchkv.config import build_config
from sketchkv.engine.llm_engine import LLMEngine, RequestOutput
from sketchkv.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto", **options):
        """`options`: any EngineConfig / CacheConfig / SchedulerConfig field (e.g. max_num_seqs=8)."""
        kw = dict(dtype=dtype, device=device, **options)
        if model is not None:
            kw["model"] = model
        self.engine = LLMEngine(build_config(**kw))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        items = prompts if prompts is not None else prompt_token_ids
        if items is None:
            raise ValueError("give prompts or prompt_token_ids")
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(items)
        ids = [self.engine.add_request(p, sp).request_id for p, sp in zip(items, params)]
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[i] for i in ids]

    def teacher_force(self, prompt_token_ids: list[list[int]], continuation_token_ids: list[list[int]]):
        """Per-position log-probabilities of forced continuations (see LLMEngine.teacher_force)."""
        return self.engine.teacher_force(prompt_token_ids, continuation_token_ids)

    def speculative_metrics(self) -> dict:
        """Speculative decoding counters since start: verifications, drafted / accepted tokens, mean
        accepted length per step (accepted drafts + 1), acceptance by draft position. {} when off."""
        spec = self.engine.runner.spec
        return spec.metrics() if spec is not None else {}

    def tier_stats(self, per_sequence: bool = False):
        """Host KV tier accounting (sparse_host_tier=True; None otherwise): TierStats with hits, misses,
        hit_rate, pcie_read_bytes / pcie_write_bytes (totals since start), host_bytes / gpu_bytes (held
        by the tier). per_sequence=True: {request_id: TierStats(host_bytes, gpu_bytes)} of live sequences."""
        return self.engine.tier_sequence_stats() if per_sequence else self.engine.tier_stats()

    def qsa_memory(self) -> dict:
        """qwen4_exp: GPU bytes per cached token per QSA layer (block keys, GPU K/V, hot slot map; with the
        host tier the K/V are in host RAM) and per-sequence state, measured (ModelRunner.qsa_memory)."""
        return self.engine.runner.qsa_memory()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (also done at interpreter exit)."""
        self.engine.shutdown()

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([prompt], sampling_params)[0]
