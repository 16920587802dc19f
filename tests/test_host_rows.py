"""Which batch rows each host of a real TPU topology must load (sharding.host_batch_rows), and multi-slice meshes
(mesh.dcn_data / mesh.dcn_fsdp), on the device descriptions that libtpu gives for pod topologies without chips.

`jax.experimental.topologies.get_topology_desc` describes a pod's devices (ids, ICI coordinates, process_index,
slice_index) from the CPU; the meshes are built exactly as training builds them (sharding.make_mesh, i.e.
jax.make_mesh over those devices). The reference for every host's rows is computed here from the mesh's device
array alone: the device at mesh position (i, j, k) holds row block i*fsdp + j. Without libtpu these tests skip,
except in a CI lane that installed it for its jax (programs.skip_without_libtpu), where they fail.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from coupled_qk_jax import sharding as shd
from coupled_qk_jax.errors import UserError

from programs import skip_without_libtpu


def topology_devices(name: str, **kwargs) -> list:
    """The devices of the TPU topology ``name`` (e.g. "v5e:4x4"), described by libtpu from the CPU."""
    skip_without_libtpu()
    # Only a description is made (no chip is claimed); concurrent test processes must not refuse each other.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies  # noqa: PLC0415

    return list(topologies.get_topology_desc(name, platform="tpu", **kwargs).devices)


def reference_rows(mesh, batch: int) -> dict[int, set[int]]:
    """process -> the rows its devices hold, from the mesh's device array positions alone."""
    data, fsdp, _ = mesh.devices.shape
    per_block = batch // (data * fsdp)
    rows: dict[int, set[int]] = {}
    for (i, j, _), device in np.ndenumerate(mesh.devices):
        block = i * fsdp + j
        rows.setdefault(device.process_index, set()).update(range(block * per_block, (block + 1) * per_block))
    return rows


def check_every_host(mesh, batch: int) -> dict[int, np.ndarray]:
    """host_batch_rows of every process against the reference; each row is loaded by exactly the processes whose
    devices replicate it. Returns process -> rows."""
    reference = reference_rows(mesh, batch)
    got = {p: shd.host_batch_rows(mesh, p, batch) for p in reference}
    data, fsdp, _ = mesh.devices.shape
    per_block = batch // (data * fsdp)
    for p, rows in got.items():
        assert rows.dtype == np.int64 and np.all(np.diff(rows) > 0), rows  # ascending, each row once
        assert set(rows.tolist()) == reference[p], p
    for row in range(batch):
        block = row // per_block
        holders = {d.process_index for d in mesh.devices[block // fsdp, block % fsdp, :]}
        assert {p for p, rows in got.items() if row in rows} == holders, row
    return got


def blocks(rows: np.ndarray) -> int:
    """How many contiguous runs ``rows`` form."""
    return 1 + int(np.sum(np.diff(rows) != 1))


# v4 descriptions come with two devices per chip, which jax.make_mesh refuses (it wants megacore); v5p is
# the 3-D torus here.
TOPOLOGIES = ["v5e:4x4", "v5p:2x2x4"]
MESHES = {"data": {"data": -1, "fsdp": 1, "tensor": 1}, "fsdp": {"data": 1, "fsdp": -1, "tensor": 1},
          "data x tensor": {"data": -1, "fsdp": 1, "tensor": 4},
          "tensor across hosts": {"data": 2, "fsdp": 1, "tensor": -1},
          "data x fsdp x tensor": {"data": 2, "fsdp": -1, "tensor": 2}}


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("layout", list(MESHES))
def test_every_host_loads_the_rows_its_devices_hold(topology, layout):
    mesh = shd.make_mesh(MESHES[layout], topology_devices(topology))
    data, fsdp, _ = mesh.devices.shape
    check_every_host(mesh, 2 * data * fsdp)  # two rows per device: blocks, not single rows
    if layout == "tensor across hosts":  # the case of rows that two processes must both load
        assert all(len({d.process_index for d in group}) > 1 for group in mesh.devices.reshape(data * fsdp, -1))


def test_v5e_16_and_256_hosts_hold_several_blocks():
    """The measurement that motivated host rows: with a pure data-parallel mesh jax.make_mesh orders the devices
    along the ICI ring, so 2 of v5e-16's 4 hosts and all 64 of v5e-256's hold more than one block of rows."""
    mesh16 = shd.make_mesh(MESHES["data"], topology_devices("v5e:4x4"))
    rows16 = check_every_host(mesh16, 32)
    assert sorted(blocks(r) for r in rows16.values()) == [1, 1, 2, 3]
    mesh256 = shd.make_mesh(MESHES["data"], topology_devices("v5e:16x16"))
    rows256 = check_every_host(mesh256, 256)
    assert all(blocks(r) > 1 for r in rows256.values())
    assert rows256[63].tolist() == [238, 239, 254, 255]


def test_batch_the_mesh_cannot_divide_is_one_line():
    mesh = shd.make_mesh(MESHES["data"], topology_devices("v5e:4x4"))
    with pytest.raises(UserError, match=r"^the batch of 24 rows is not divisible by the mesh's 16 data-parallel "
                                        r"devices \(mesh.data \* mesh.fsdp\); change the batch size or the mesh$"):
        shd.host_batch_rows(mesh, 0, 24)


# ------------------------------------------------------------------------------------------------------ multi-slice
def test_multi_slice_mesh_puts_the_slices_outermost():
    """Two v5e-4 slices: dcn_data=2 doubles the data axis, data index i in slice i // data; dcn_fsdp=2 likewise for
    fsdp. Every slice keeps its own devices together, tensor stays inside a slice, and the hosts' rows cover the
    batch."""
    devices = topology_devices("v5e:2x2", num_slices=2)
    assert sorted({d.slice_index for d in devices}) == [0, 1]
    mesh = shd.make_mesh({"data": 2, "fsdp": 1, "tensor": 2, "dcn_data": 2}, devices)
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    for (i, _, _), device in np.ndenumerate(mesh.devices):
        assert device.slice_index == i // 2
    assert sorted(d.id for d in mesh.devices.reshape(-1)) == sorted(d.id for d in devices)
    check_every_host(mesh, 8)

    mesh = shd.make_mesh({"data": 1, "fsdp": -1, "tensor": 1, "dcn_fsdp": 2}, devices)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    for (_, j, _), device in np.ndenumerate(mesh.devices):
        assert device.slice_index == j // 4
    check_every_host(mesh, 16)
    assert shd.mesh_shape({"data": -1, "fsdp": 1, "tensor": 2, "dcn_data": 2}, 8) == (4, 1, 2)


def test_multi_slice_mistakes_are_one_line():
    devices = topology_devices("v5e:2x2", num_slices=2)
    with pytest.raises(UserError, match=r"^mesh.dcn_data\*mesh.dcn_fsdp = 4 but the devices span 2 slice\(s\); set "
                                        r"them so that their product is 2$"):
        shd.make_mesh({"data": 1, "fsdp": 1, "tensor": 2, "dcn_data": 4}, devices)
    with pytest.raises(UserError, match=r"^mesh: 8 devices cannot form mesh.dcn_data\*mesh.dcn_fsdp = 3 equal slices$"):
        shd.make_mesh({"data": -1, "fsdp": 1, "tensor": 1, "dcn_data": 3}, devices)
    with pytest.raises(UserError, match=r"^mesh.dcn_fsdp must be an integer >= 1"):
        shd.make_mesh({"data": -1, "fsdp": 1, "tensor": 1, "dcn_fsdp": 0}, devices)
    with pytest.raises(ValueError, match=r"^mesh: data\*fsdp\*tensor = 8 but there are 4 devices per slice$"):
        shd.make_mesh({"data": 4, "fsdp": 1, "tensor": 2, "dcn_data": 2}, devices)


def test_multi_slice_needs_devices_with_slices():
    """CPU devices carry no slice_index: asking for two slices of them is a one-line UserError."""
    import jax  # noqa: PLC0415

    with pytest.raises(UserError, match=r"^mesh.dcn_data\*mesh.dcn_fsdp = 2 slices, but the devices carry no "
                                        r"slice_index"):
        shd.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, "dcn_data": 2}, jax.devices()[:1] * 2)


def test_mesh_config_has_one_slice_by_default_and_old_runs_read_so():
    from coupled_qk_jax.training import rundir  # noqa: PLC0415
    from coupled_qk_jax.training.config import MeshConfig  # noqa: PLC0415

    assert MeshConfig().sizes() == {"data": -1, "fsdp": 1, "tensor": 1, "dcn_data": 1, "dcn_fsdp": 1}
    # A config.json from before the fields: one slice, and no note (a layout field says nothing about the results).
    upgraded, notes = rundir.upgrade_config({"mesh": {"data": -1, "fsdp": 2, "tensor": 1}})
    assert upgraded == {"mesh": {"data": -1, "fsdp": 2, "tensor": 1, "dcn_data": 1, "dcn_fsdp": 1}} and notes == []
    with pytest.raises(UserError, match=r"^mesh.dcn_data must be >= 1, got 0$"):
        MeshConfig(dcn_data=0)


def test_single_process_checkpoints_from_before_host_rows_resume():
    """The stream spec that a checkpoint of the old version recorded (tests/fixtures/run_v1: one process, batch 8)
    reads as this version's spec of the same stream, every row of the batch; a 2-process one does not (its hosts
    read interleaved windows, not rows of the global batch), so its resume is refused."""
    import json  # noqa: PLC0415

    from coupled_qk_jax.data.pipeline import train_stream_spec  # noqa: PLC0415
    from coupled_qk_jax.training.loop import upgrade_stream_spec  # noqa: PLC0415

    meta = os.path.join(os.path.dirname(__file__), "fixtures", "run_v1", "checkpoints", "3", "meta", "metadata")
    with open(meta, encoding="utf-8") as f:
        old = json.load(f)["data_stream"]
    assert (old["process_index"], old["process_count"], old["batch_size_per_host"]) == (0, 1, 8)
    now = {"task": "lm", **train_stream_spec(np.zeros(7763, np.uint16), 32, 8, 0, bos_id=256), "seed": [0]}
    assert now["batch_size"] == 8 and "rows" not in now
    assert upgrade_stream_spec(old) == now
    two_hosts = {**old, "process_count": 2, "batch_size_per_host": 4}
    assert upgrade_stream_spec(two_hosts) == two_hosts
    # A spec that recorded the saving host's rows: the global stream is the same on any number of hosts.
    assert upgrade_stream_spec({**now, "rows": [[0, 4]]}) == now


def test_an_older_checkpoints_per_process_iterator_state_is_checked_against_the_step(tmp_path):
    """Older versions saved grain's iterator state per process beside the arrays; this version's data position is
    the step, so that state is only read to check that it agrees (tests/fixtures/run_v1 saved at steps 3 and 6)."""
    import shutil  # noqa: PLC0415

    from coupled_qk_jax.training.checkpoint import Checkpointer  # noqa: PLC0415

    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "run_v1", "checkpoints")
    shutil.copytree(fixture, tmp_path / "checkpoints")
    ck = Checkpointer(tmp_path / "checkpoints", read_only=True)
    try:
        assert [ck.legacy_data_position(step) for step in ck.all_steps()] == [3, 6]
        # A second process's file that disagrees: the position is unknown, one line.
        (tmp_path / "checkpoints" / "6" / "data" / "process_1-of-2.json").write_text('{"next_index": 5}')
        with pytest.raises(UserError, match=r"checkpoint step 6 in .*: its per-process data iterator states disagree"):
            ck.legacy_data_position(6)
        (tmp_path / "checkpoints" / "3" / "data" / "process_0-of-1.json").write_text("{")
        with pytest.raises(UserError, match=r"checkpoint step 3 in .*: its data iterator state .* cannot be read"):
            ck.legacy_data_position(3)
    finally:
        ck.close()
