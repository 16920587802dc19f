"""One process of a multi-process (or single-process) CPU training run, for tests/test_multihost.py.

    python tests/multihost_worker.py --phase train  --workdir DIR --local-devices 2 --mesh 1,2,2 [--eval-mesh 1,1,4]
                                     [--then-mesh 4,1,1]

The cluster comes from COUPLED_QK_COORDINATOR / COUPLED_QK_NUM_PROCESSES / COUPLED_QK_PROCESS_ID (read by
coupled_qk_jax.distributed); unset means a single process. It trains a tiny coupled_euler LM with the project's own
pieces (steps.py, optimizer.py, sharding.py) and orbax:

  train:  steps 1..N on --mesh, an orbax multi-host checkpoint after step --save-at, then on to N.
  --eval-mesh (train only, before training; the same processes, so no second cluster start-up):
          training.evaluate.evaluate_tokens of the initial params on that mesh over a fixed token stream (each host
          reads the windows of its batch slice); prints `EVAL <loss float.hex> <scored tokens>`.
  --then-mesh (train only, after the first training; the same processes again): a second training from the same
          initial state, --then-steps steps on that mesh built over the devices taken from each process in turn
          (as --device-order interleaved), without checkpoint or export.

Each process builds the same global batch for step s from a seeded generator and feeds only its own rows
(sharding.host_batch_rows) to sharding.global_batch, exactly as a data loader on each host would.
--device-order interleaved builds the mesh over the devices taken from each process in turn (as a TPU pod's ICI
order mixes hosts), so a process's rows are not one block. Each training is named `<mesh>/<device order>` (e.g.
`1,2,2/make_mesh`) and every process prints `ROWS <name> <process> <its batch rows>` and `LOSS <name> <step>
<float.hex>` per step; after the first training `EXPORT <sha256 of export.flatten_params of the params> <whether a
weight is fully addressable here>`, and `DONE <process> <processes> <devices>` at the end; first
`COMPILATION_CACHE <whether JAX's persistent compilation cache is on>`.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=("train",), required=True)
    p.add_argument("--workdir", required=True, help="absolute; shared by all processes")
    p.add_argument("--local-devices", type=int, default=2, help="fake CPU devices in this process")
    p.add_argument("--mesh", default="1,2,2", help="data,fsdp,tensor")
    p.add_argument("--eval-mesh", default="", help="data,fsdp,tensor of an evaluation before training (train only)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--save-at", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--device-order", choices=("make_mesh", "interleaved"), default="make_mesh",
                   help="the mesh's device order: jax.make_mesh's, or one device of each process in turn")
    p.add_argument("--then-mesh", default="", help="data,fsdp,tensor of a second training after the first (train "
                   "only), on the interleaved device order")
    p.add_argument("--then-steps", type=int, default=3)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # Before JAX starts its CPU backend: the device count is read once. The other flags are kept: the test passes
    # its session's compile-time switches (tests/conftest.py), alike in every run compared.
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    os.environ["XLA_FLAGS"] = " ".join([f"--xla_force_host_platform_device_count={args.local_devices}", *kept])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from coupled_qk_jax.distributed import initialize_distributed

    multi = initialize_distributed(initialization_timeout=60)

    import jax

    # Off in a multi-process CPU run (distributed.symmetric_compilation_cache); the test session's cache otherwise.
    print(f"COMPILATION_CACHE {jax.config.jax_enable_compilation_cache}", flush=True)
    import numpy as np
    import orbax.checkpoint as ocp

    from coupled_qk_jax import sharding as shd
    from coupled_qk_jax.config import ModelConfig
    from coupled_qk_jax.model import TransformerLM
    from coupled_qk_jax.training import optimizer, steps
    from coupled_qk_jax.training.config import TrainConfig

    assert jax.local_device_count() == args.local_devices, jax.local_devices()
    cfg = ModelConfig(variant="coupled_euler", vocab_size=64, max_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                      coupling_hidden=8)
    train_cfg = TrainConfig(steps=args.steps, warmup_steps=2, lr=1e-2)
    model = TransformerLM(cfg, seed=0)
    graphdef, params = steps.split_model(model)
    tx = optimizer.make_optimizer(params, train_cfg)
    # On the host (numpy): each training puts it on its mesh and donates that copy, so a second one starts from it.
    host_state = jax.device_get(steps.init_train_state(params, tx))

    step_fn, base_key = steps.make_train_step(graphdef, tx), jax.random.key(7)

    def train(mesh_spec: str, order: str, n_steps: int, save_at: int = 0):
        """Trains n_steps from host_state on the mesh (an orbax checkpoint after step save_at, if > 0); returns
        the final state."""
        devices = jax.devices()
        if order == "interleaved":
            per_process = [[d for d in devices if d.process_index == p] for p in range(jax.process_count())]
            devices = [d for turn in zip(*per_process) for d in turn]
        mesh = shd.make_mesh(dict(zip(shd.MESH_AXES, map(int, mesh_spec.split(",")))), devices)
        shardings = shd.train_state_shardings(model, tx, host_state, mesh)
        # The key of step s is fold_in(base_key, s), derived inside the step from the state's step as the loop does.
        train_step = shd.jit_sharded(
            lambda state, batch: step_fn(state, batch, jax.random.fold_in(base_key, state["step"])), mesh, shardings,
            donate=True)
        name = f"{mesh_spec}/{order}"
        rows = shd.host_batch_rows(mesh, jax.process_index(), args.batch)
        print(f"ROWS {name} {jax.process_index()} {','.join(map(str, rows))}", flush=True)

        def batch_for(step: int) -> dict:
            tokens = np.random.default_rng([1234, step]).integers(0, cfg.vocab_size, (args.batch, 17),
                                                                  dtype=np.int32)
            mine = tokens[rows]  # this host's rows only
            return shd.global_batch({"inputs": mine[:, :-1], "targets": mine[:, 1:]}, mesh)

        mngr = None
        if save_at:
            ckpt_dir = os.path.join(os.path.abspath(args.workdir), "ckpt")
            mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        state = jax.device_put(host_state, shardings)
        for step in range(1, n_steps + 1):
            state, metrics = train_step(state, batch_for(step))
            loss = float(np.asarray(metrics["loss"].addressable_data(0)))
            print(f"LOSS {name} {step} {loss.hex()}", flush=True)
            if step == save_at:
                mngr.save(step, args=ocp.args.StandardSave(state))
                mngr.wait_until_finished()
        if mngr is not None:
            mngr.wait_until_finished()
            mngr.close()
        return state

    if args.eval_mesh:
        from coupled_qk_jax.training.evaluate import evaluate_tokens

        eval_mesh = shd.make_mesh(dict(zip(shd.MESH_AXES, map(int, args.eval_mesh.split(",")))))
        eval_shardings = shd.train_state_shardings(model, tx, host_state, eval_mesh)["params"]
        tokens = np.random.default_rng(99).integers(0, cfg.vocab_size, 1000).astype(np.int32)
        eval_step = shd.jit_sharded(steps.make_eval_step(graphdef), eval_mesh, eval_shardings)
        result = evaluate_tokens(eval_step, jax.device_put(params, eval_shardings), tokens, 16, args.batch, eval_mesh,
                                 bos_id=0)
        print(f"EVAL {float(result['loss']).hex()} {result['tokens']}", flush=True)

    state = train(args.mesh, args.device_order, args.steps, args.save_at)
    # What export.py writes: every parameter whole on every process (all-gathered where fsdp spans the processes).
    import hashlib

    from coupled_qk_jax.export import flatten_params

    tensors = flatten_params(state["params"])
    digest = hashlib.sha256(b"".join(k.encode() + tensors[k].tobytes() for k in sorted(tensors))).hexdigest()
    print(f"EXPORT {digest} {state['params']['blocks'][0]['attn']['wq'].is_fully_addressable}", flush=True)
    if args.then_mesh:
        train(args.then_mesh, "interleaved", args.then_steps)
    print(f"DONE {jax.process_index()} {jax.process_count()} {jax.device_count()}", flush=True)
    if multi:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
