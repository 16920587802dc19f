"""Token-level evaluation: cross-entropy and perplexity over a whole split, every token scored exactly once.

The split's token stream is ``[eot] + tokens`` cut into non-overlapping windows of T (``data.pipeline.eval_batches``
with ``bos_id=eot``), so each of its N tokens is a target exactly once, the first predicted from the document
separator. Padding (the last partial window, filler rows) has target -100 and is not counted. Per batch the device
returns the summed NLL (float32) and the token count; the host accumulates them in float64 / Python int, so the
result does not depend on the batch size beyond float32 rounding inside one batch.

    loss = sum(NLL) / tokens        ppl = exp(loss)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from jax.sharding import Mesh

from coupled_qk_jax import sharding as shd
from coupled_qk_jax.data.pipeline import eval_batches, num_eval_batches


def evaluate_tokens(eval_step: Callable, params: Any, tokens: np.ndarray, seq_len: int, global_batch_size: int,
                    mesh: Mesh, *, bos_id: int | None, max_batches: int = 0) -> dict[str, float | int]:
    """Mean token NLL and perplexity of a split.

    Args:
      eval_step: ``(params, batch) -> (nll_sum, count)``, e.g. ``sharding.jit_sharded(steps.make_eval_step(graphdef),
        mesh, params_shardings)``.
      tokens: [N] token ids of the split (this host reads its own windows: window k goes to batch slice k mod
        slices, the slices of sharding.process_batch_slice).
      seq_len: T.
      global_batch_size: windows per batch over all hosts (each host feeds ``global_batch_size / slices``).
      bos_id: the end-of-text id; with it all N tokens are scored, without it N - 1.
      max_batches: 0 = the whole split; otherwise only the first ``max_batches`` batches (a cheaper estimate).

    Returns:
      {"loss": mean NLL in nats, "ppl": exp(loss), "tokens": number of scored tokens}; loss and ppl are floats, or
      float64 arrays [S] when ``eval_step`` is vmapped over a seed axis of ``params``.
    """
    # The training rule (sharding.process_batch_slice): hosts that hold the same batch rows (a tensor axis across
    # hosts) get the same slice index and feed the same windows; window k goes to slice k mod slices.
    index, slices = shd.process_batch_slice(mesh, global_batch_size)
    per_host = global_batch_size // slices
    total = num_eval_batches(int(tokens.shape[0]), seq_len, per_host, bos_id=bos_id, process_count=slices)
    limit = total if max_batches <= 0 else min(total, max_batches)
    outs = []
    batches = eval_batches(tokens, seq_len, per_host, bos_id=bos_id, process_index=index, process_count=slices)
    for i, batch in enumerate(batches):
        if i == limit:
            break
        outs.append(eval_step(params, shd.global_batch(batch, mesh)))  # async dispatch; read back below
    # float64 accumulation on the host; a seed-parallel eval step returns [S] sums (one per seed, same count).
    nll = np.sum([np.asarray(s, np.float64) for s, _ in outs], axis=0)
    count = sum(int(np.asarray(c).reshape(-1)[0]) for _, c in outs)
    loss = nll / max(count, 1)
    ppl = np.where(loss < 700, np.exp(np.minimum(loss, 700)), np.inf)
    if np.ndim(loss) == 0:
        return {"loss": float(loss), "ppl": float(ppl), "tokens": count}
    return {"loss": loss, "ppl": ppl, "tokens": count}
