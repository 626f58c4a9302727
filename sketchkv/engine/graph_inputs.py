"""The integer inputs of CUDA graphs (decode, MTP verification, the drafter, the commit's replay), staged on the host.

A graph's inputs are views of device buffers, each with a host twin (pinned on a GPU) laid out like it: a step writes
its inputs, padded rows included, into the twin with numpy and sends it in one non-blocking copy. Built as device
tensors and written in piece by piece, they were a dozen or more small ops per step, pageable copies among them: ~1.1 ms
of host time per decode step at 8 sequences on an H100 (issue 41)."""
import numpy as np
import torch

from sketchkv.engine.sequence import Sequence


def staged(shape, dtype: torch.dtype, device: torch.device, fill=0) -> tuple[torch.Tensor, torch.Tensor]:
    """(host twin, device buffer) of `shape`, both `fill` (a scalar, or e.g. one value per row as a column)."""
    host = torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
    host.numpy()[:] = fill
    return host, host.to(device, copy=True)


def copy_event(device: torch.device) -> torch.cuda.Event | None:
    """What `send` records and `host_views` waits on: a CUDA event on a GPU, None on CPU (copies are synchronous)."""
    return torch.cuda.Event() if device.type == "cuda" else None


def host_views(sent: torch.cuda.Event | None, *twins: torch.Tensor) -> list[np.ndarray]:
    """Host twins as numpy arrays to write a step's inputs into, once the last copy out of them has read them
    (`sent`; None on CPU, where copies are synchronous)."""
    if sent is not None:
        sent.synchronize()
    return [t.numpy() for t in twins]


def send(copies: list[tuple[torch.Tensor, torch.Tensor]], sent: torch.cuda.Event | None) -> None:
    """(device buffer, host twin) pairs in non-blocking copies on the current stream; `sent` marks their end."""
    for dst, src in copies:
        dst.copy_(src, non_blocking=True)
    if sent is not None:
        sent.record(torch.cuda.current_stream(copies[0][0].device))


def write_tables(out: np.ndarray, seqs: list[Sequence]) -> None:
    """Block tables into `out` [batch bucket, rows per sequence, width]: each sequence's in its rows, 0 past its end
    and in padded sequences' rows (block 0, the scratch block that padded rows read)."""
    for i, seq in enumerate(seqs):
        n = len(seq.block_table)
        out[i, :, :n] = seq.block_table_tensor().numpy()
        out[i, :, n:] = 0
    out[len(seqs):] = 0
