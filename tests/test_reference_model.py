"""The bundled reference model (sketchkv/assets/reference-model, issue 3): sketchkv and transformers agree on it,
and the default command writes Python with it."""
import ast
import os
import subprocess
import sys

import pytest
import torch

from sketchkv import LLM, SamplingParams
from sketchkv.config import default_model

REF = default_model()
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(REF, "model.safetensors")),
                                reason="the reference model is not in sketchkv/assets")


def _heldout_prompt(n_tokens: int) -> list[int]:
    from sketchkv.eval.common import heldout_token_ids
    return heldout_token_ids(REF, n_tokens)  # packages never trained on (jinja2 is one of our dependencies)


def test_greedy_continuation_matches_transformers_fp32_cpu():
    from transformers import AutoModelForCausalLM
    prompt = _heldout_prompt(1500)
    n = 64
    ours = LLM(REF, device="cpu", dtype="float32").generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(REF, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    assert ours.token_ids == ref[0, len(prompt):].tolist()


def test_default_generate_writes_python():
    """`sketchkv generate` with no --model: the bundled model continues the default prompt with code that parses."""
    r = subprocess.run([sys.executable, "-m", "sketchkv", "generate", "--max-tokens", "96", "--temperature", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # the last lines may stop mid-statement: keep the longest prefix that parses
    for end in range(len(lines), 0, -1):
        try:
            ast.parse("\n".join(lines[:end]))
            break
        except SyntaxError:
            continue
    else:
        end = 0
    assert end >= 8, f"no parsable Python in the output:\n{r.stdout}"
    assert "96 generated" in r.stderr
