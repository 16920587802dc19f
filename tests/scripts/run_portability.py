"""Issue 24.3, run by tests/test_run.py in a subprocess with 8 CPU devices: runs trained on a (8, 1, 1) and on a
(1, 4, 2) mesh are read back on one device and on two (training/run.py's Run, as eval.py, sample.py and export.py
read them) with the same results: eval loss to float32 summation order, greedy tokens and exported tensors equal;
the (1, 4, 2) run also generates the same greedy tokens opened on a (2, 2, 2) mesh.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/scripts/run_portability.py TMPDIR

Prints one JSON line with what it compared; exits non-zero (an assertion) on any difference.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: test_training's helpers

from coupled_qk_jax import generate  # noqa: E402
from coupled_qk_jax.export import export_run, load_exported  # noqa: E402
from coupled_qk_jax.training import loop  # noqa: E402
from coupled_qk_jax.training.run import Run  # noqa: E402
from test_training import leaves_with_names, tiny_config  # noqa: E402

PROMPTS = [np.array([256, 97, 98], np.int32), np.array([256, 32], np.int32)]


def main(tmp: str) -> None:
    assert jax.device_count() == 8, jax.device_count()
    report = {}
    for name, mesh in (("data8", dict(data=8, fsdp=1, tensor=1)), ("fsdp4_tensor2", dict(data=1, fsdp=4, tensor=2))):
        cfg = tiny_config(__import__("pathlib").Path(tmp), steps=2, eval_batches=1)
        cfg.model.vocab_size = 264  # divisible by fsdp=4 (the byte tokenizer's 257 ids, the rest padding)
        cfg.mesh.update(**mesh)
        cfg.checkpoint.update(every=2, async_save=False)
        workdir = os.path.join(tmp, name)
        summary, state = loop.train(cfg, workdir, progress=False, return_state=True)
        assert summary["mesh"] == mesh, summary["mesh"]
        trained = leaves_with_names(state["params"])
        results = {}
        for reader in ("data:1", "data:2"):
            run = Run.open(workdir, mesh=reader)
            assert run.mesh.size == int(reader.split(":")[1]) and run.steps == [2]
            restored = leaves_with_names(jax.device_get(run.params()))
            assert restored.keys() == trained.keys()
            for k in trained:  # the very bits that were trained, on any mesh
                np.testing.assert_array_equal(restored[k], trained[k], err_msg=f"{name} {reader} {k}")
            loss = run.evaluate("validation")["loss"]
            generator = generate.Generator(run.model(), vocab_limit=run.tokenizer.vocab_size)
            if reader == "data:1":  # one device: the plain, unsharded program
                assert generator.mesh is None, generator.mesh
            else:
                assert generator.mesh.size == 2, generator.mesh
            greedy = generator.generate(PROMPTS, 6, generate.Sampling(temperature=0))
            out = export_run(workdir, os.path.join(tmp, f"{name}_export_{reader.replace(':', '')}"), mesh=reader)
            exported = leaves_with_names(jax.device_get(
                __import__("flax").nnx.to_pure_dict(__import__("flax").nnx.state(load_exported(out)[0]))))
            results[reader] = (loss, [g.tolist() for g in greedy], exported)
        (loss1, tok1, exp1), others = results["data:1"], [results["data:2"]]
        # the training's own final whole-split evaluation ran on 8 devices: the same sum in another order
        assert abs(loss1 - summary["val_loss"]) <= 1e-6 * abs(loss1), (loss1, summary["val_loss"])
        for loss, tok, exp in others:
            assert abs(loss - loss1) <= 1e-6 * abs(loss1), (name, loss, loss1)
            assert tok == tok1, (name, tok, tok1)
            for k in exp1:
                np.testing.assert_array_equal(exp[k], exp1[k], err_msg=f"{name} export {k}")
        if name == "fsdp4_tensor2":
            # sample.py's path on a mesh (issue 25.4): Run.open(mesh=...) then Generator(run.model()), which finds the
            # mesh on the restored parameters; 2 prompts on data x fsdp = 4 rows: two are padding
            sharded = generate.Generator(Run.open(workdir, mesh="data:2,fsdp:2,tensor:2").model(),
                                         vocab_limit=run.tokenizer.vocab_size)
            assert dict(sharded.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}, sharded.mesh
            tokens = [g.tolist() for g in sharded.generate(PROMPTS, 6, generate.Sampling(temperature=0))]
            assert tokens == tok1, (tokens, tok1)
        report[name] = {"losses": [loss1] + [o[0] for o in others], "train_loss": summary["val_loss"],
                        "tokens": tok1}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
