"""The data-preparation job (coupled_qk_jax/data/prepare.py) and the ``tokens:DIR`` corpus it feeds
(coupled_qk_jax/data/prepared.py): shards against the token cache, worker-count independence, resume after an
interruption, checksums, nanoGPT folders, and training on prepared shards without tokenising.

Every corpus here is tiny (a few KB of text, or the first 120 KB of the standard library) and every tokenizer is the
byte tokenizer or a 300-token BPE, so nothing is downloaded and no test takes more than a few seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest

from coupled_qk_jax.data import prepare as prep
from coupled_qk_jax.data import prepared, token_cache
from coupled_qk_jax.data.corpora import SPLITS, CorpusError, CorpusSpec
from coupled_qk_jax.data.pipeline import train_batches
from coupled_qk_jax.data.prepared import ShardedTokens, open_tokens

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_corpus(root: pathlib.Path, n_files: int = 24, words: int = 60) -> CorpusSpec:
    """A text_dir corpus of short documents (a few hundred bytes each), so chunks hold several documents."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS, size=words)) + f"\n# file {i}\n")
    return CorpusSpec("text_dir", path=str(root), split_fractions=(0.6, 0.2, 0.2))


def shard_files(out: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def concatenated(out: pathlib.Path, manifest: dict, split: str) -> np.ndarray:
    dtype = np.dtype(manifest["dtype"])
    parts = [np.fromfile(out / s["file"], dtype=dtype) for s in manifest["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.empty(0, dtype)


# Small enough that every split has several shards and shards end inside chunks (a chunk is ~1,000 tokens here).
SMALL = dict(shard_tokens=700, chunk_bytes=1000)


def test_stdlib_shards_equal_the_token_cache(tmp_path):
    """The shards of each split, concatenated, are build_token_cache's <split>.bin token for token, under the cache's
    own BPE; the split's counts and text/token hashes equal the cache manifest's."""
    spec = CorpusSpec("stdlib", max_bytes=120_000)
    cache = token_cache.build_token_cache(spec, tmp_path / "cache", vocab_size=300, bpe_train_bytes=60_000)
    tok_file = cache.directory / "tokenizer.json"
    out = tmp_path / "prepared"
    manifest = prep.prepare(spec, out, tokenizer=str(tok_file), vocab_size=300, shard_tokens=20_000,
                            chunk_bytes=16_000)
    assert len(manifest["splits"]["train"]["shards"]) >= 2  # the equality spans shard boundaries
    for split in SPLITS:
        want = np.asarray(cache.tokens(split))
        assert want.size > 0
        np.testing.assert_array_equal(concatenated(out, manifest, split), want)
        sizes = [s["tokens"] for s in manifest["splits"][split]["shards"]]
        assert all(n == 20_000 for n in sizes[:-1]) and 0 < sizes[-1] <= 20_000
        for key in ("tokens", "documents", "bytes", "text_sha256", "tokens_sha256"):
            assert manifest["splits"][split][key] == cache.manifest["splits"][split][key], (split, key)
    assert manifest["tokenizer"]["sha256"] == token_cache.tokenizer_sha256(cache)
    assert manifest["totals"]["tokens"] == sum(cache.manifest["splits"][s]["tokens"] for s in SPLITS)
    assert not (out / prep.PROGRESS).exists()


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> str:
    """A 300-token BPE trained once on the tiny corpus (prepare's own training would work too; a file keeps the
    tests independent of training determinism)."""
    root = tmp_path_factory.mktemp("bpe")
    spec = write_corpus(root / "corpus")
    from coupled_qk_jax.data.corpora import iter_documents
    from coupled_qk_jax.data.tokenizer import BPETokenizer

    tok = BPETokenizer.train(iter_documents(spec, "train"), 300)
    tok.save(root / "tokenizer.json")
    return str(root / "tokenizer.json")


def test_one_and_two_workers_write_identical_files(tmp_path, bpe_file):
    spec = write_corpus(tmp_path / "corpus")
    sizes = dict(shard_tokens=150, chunk_bytes=1000)  # the BPE packs a ~1,000-byte chunk into ~250 tokens
    one = prep.prepare(spec, tmp_path / "one", tokenizer=bpe_file, workers=1, **sizes)
    two = prep.prepare(spec, tmp_path / "two", tokenizer=bpe_file, workers=2, **sizes)
    assert one == two
    files = shard_files(tmp_path / "one")
    assert files == shard_files(tmp_path / "two")
    assert sum(len(one["splits"][s]["shards"]) for s in SPLITS) >= 6
    # Independent reference: each split is its documents encoded one by one, each followed by <|endoftext|>.
    from coupled_qk_jax.data.corpora import iter_documents
    from coupled_qk_jax.data.tokenizer import BPETokenizer

    tok = BPETokenizer.load(bpe_file)
    for split in SPLITS:
        want = [x for d in iter_documents(spec, split) for x in [*tok.encode(d).tolist(), tok.eot_id]]
        np.testing.assert_array_equal(concatenated(tmp_path / "two", two, split), np.asarray(want, np.uint16))
        for s in two["splits"][split]["shards"]:
            assert hashlib.sha256(files[s["file"]]).hexdigest() == s["sha256"]


def test_resume_after_an_interruption_continues_from_the_finished_shards(tmp_path):
    spec = write_corpus(tmp_path / "corpus")
    reference = prep.prepare(spec, tmp_path / "ref", tokenizer="byte", **SMALL)
    out = tmp_path / "out"

    class Interrupted(Exception):
        pass

    def stop_at_third(split: str, written: int) -> None:
        if split == "train" and written == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        prep.prepare(spec, out, tokenizer="byte", after_shard=stop_at_third, **SMALL)
    assert not (out / prepared.MANIFEST).exists() and (out / prep.PROGRESS).exists()
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("train-*.bin")}
    assert sorted(before) == ["train-00000.bin", "train-00001.bin", "train-00002.bin"]
    # A shard that is not in progress.json yet (killed between its rename and the record) is simply rewritten.
    (out / "train-00003.bin").write_bytes(b"\x00\x01")
    written = []
    manifest = prep.prepare(spec, out, tokenizer="byte", after_shard=lambda s, k: written.append((s, k)), **SMALL)
    assert manifest == reference
    assert shard_files(out) == shard_files(tmp_path / "ref")
    assert written[0] == ("train", 4)  # shards 1..3 were not written again
    for name, stat in before.items():
        p = out / name
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == stat, name


def test_a_damaged_shard_is_a_one_line_error_and_a_rerun_repairs_it(tmp_path):
    spec = write_corpus(tmp_path / "corpus")
    manifest = prep.prepare(spec, tmp_path / "out", tokenizer="byte", **SMALL)
    good = open_tokens(tmp_path / "out")
    np.testing.assert_array_equal(np.asarray(good.tokens("validation")),
                                  concatenated(tmp_path / "out", manifest, "validation"))
    shard = tmp_path / "out" / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1  # same size, one bit different
    shard.write_bytes(bytes(data))
    with pytest.raises(CorpusError) as e:
        open_tokens(tmp_path / "out")
    msg = str(e.value)
    assert "train-00001.bin" in msg and "coupled_qk_jax.data.prepare" in msg and "\n" not in msg
    open_tokens(tmp_path / "out", verify=False)  # sizes only: the flip goes unnoticed, as documented
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(CorpusError, match="train-00001.bin.*bytes"):
        open_tokens(tmp_path / "out", verify=False)
    # A rerun checks the shards and rewrites from the bad one on.
    assert prep.prepare(spec, tmp_path / "out", tokenizer="byte", **SMALL) == manifest
    open_tokens(tmp_path / "out")


def test_user_mistakes_are_one_line_and_exit_2(tmp_path, capsys):
    spec = write_corpus(tmp_path / "corpus")
    (tmp_path / "afile").write_text("x")
    cases = [
        (["--corpus", f"text_dir:{tmp_path / 'missing'}", "--out", str(tmp_path / "o1"), "--tokenizer=byte"],
         "does not exist"),
        (["--corpus", str(spec), "--out", str(tmp_path / "afile"), "--tokenizer=byte"], "is a file"),
        (["--corpus", str(spec), "--out", str(tmp_path / "afile" / "sub"), "--tokenizer=byte"], "cannot be written"),
        (["--corpus", str(spec), "--out", str(tmp_path / "o2"), "--vocab_size=100"], "vocab_size >= 258"),
        (["--corpus", str(spec), "--out", str(tmp_path / "o3"), "--tokenizer=byte", "--vocab_size=100"],
         "more than --vocab_size 100"),
        (["--corpus", str(spec), "--out", str(tmp_path / "o4"), "--tokenizer", str(tmp_path / "no.json")],
         "no tokenizer file"),
    ]
    for argv, expected in cases:
        assert prep.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, (argv, err)
    # Another request into a directory that holds a preparation is refused, not mixed.
    assert prep.main(["--corpus", str(spec), "--out", str(tmp_path / "o5"), "--tokenizer=byte", "--workers=1",
                      "--shard_tokens=700"]) == 0
    assert prep.main(["--corpus", str(spec), "--out", str(tmp_path / "o5"), "--tokenizer=byte", "--workers=1",
                      "--shard_tokens=800"]) == 2
    assert "shard_tokens" in capsys.readouterr().err


def test_sharded_tokens_index_like_their_concatenation():
    rng = np.random.default_rng(1)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        sizes = [5, 1, 9, 4]
        parts = [rng.integers(0, 60000, size=n).astype(np.uint16) for n in sizes]
        paths = []
        for k, p in enumerate(parts):
            paths.append(pathlib.Path(d) / f"s{k}.bin")
            p.tofile(paths[-1])
        whole = np.concatenate(parts)
        st = ShardedTokens(paths, sizes, np.uint16)
        assert st.shape == whole.shape and len(st) == whole.size and np.ndim(st) == 1
        idx = rng.integers(-whole.size, whole.size, size=(3, 7))
        np.testing.assert_array_equal(st[idx], whole[idx])
        assert st[4] == whole[4] and st[5] == whole[5] and st[-1] == whole[-1]
        np.testing.assert_array_equal(st[3:15:2], whole[3:15:2])
        np.testing.assert_array_equal(np.asarray(st), whole)
        np.testing.assert_array_equal(pickle.loads(pickle.dumps(st))[np.arange(whole.size)], whole)
        with pytest.raises(IndexError):
            st[np.asarray([whole.size])]
        # The training pipeline over the shards gives the batches it gives over the concatenated array.
        a = train_batches(st, 4, 3, seed=0, bos_id=7)
        b = train_batches(whole, 4, 3, seed=0, bos_id=7)
        for i in range(5):
            for key in ("inputs", "targets"):
                np.testing.assert_array_equal(a[i][key], b[i][key])


def _head_tail(data: bytes) -> str:
    mib = 1 << 20
    return hashlib.sha256(f"{len(data)}\n".encode() + data[:mib] + data[max(len(data) - mib, mib):]).hexdigest()


def test_nanogpt_folder(tmp_path):
    rng = np.random.default_rng(2)
    train = rng.integers(0, 50257, size=(1 << 20) + 300).astype(np.uint16)  # over 2 MiB: head and tail differ
    val = rng.integers(0, 50257, size=500).astype(np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    (tmp_path / "meta.pkl").write_bytes(b"not a pickle: never unpickled")
    data = open_tokens(tmp_path, vocab_size=50304)  # the model's padded GPT-2 vocabulary
    assert (data.vocab_size, data.eot_id, data.tokenizer) == (50257, 50256, None)
    np.testing.assert_array_equal(np.asarray(data.tokens("train")), train)
    np.testing.assert_array_equal(data.tokens("validation"), val)
    assert data.tokens("test").size == 0  # nanoGPT has no test split: empty, not a copy of validation
    contents = token_cache.source_contents(f"tokens:{tmp_path}")
    raw = (tmp_path / "train.bin").read_bytes()
    assert contents["files"] == [["train.bin", len(raw), _head_tail(raw), "train"],
                                 ["val.bin", 1000, hashlib.sha256(val.tobytes()).hexdigest(), "validation"]]
    assert data.manifest["splits"]["train"]["head_tail_sha256"] == _head_tail(raw)
    with pytest.raises(CorpusError, match="meta.json"):
        open_tokens(tmp_path, vocab_size=100)  # not GPT-2: the end-of-text id must be given
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 65, "eot_id": 0}))
    assert (open_tokens(tmp_path).vocab_size, open_tokens(tmp_path).eot_id) == (65, 0)


def test_training_on_a_prepared_directory_reads_no_corpus_and_hashes_no_shard(tmp_path, monkeypatch):
    """A tiny LM trains a few steps on tokens:DIR (the train split in several shards). The data fingerprint comes from
    the manifest: file_sha256 (which hashes corpus files), the shards' own checksum and the token cache are never
    called, so start-up reads no token file whole."""
    from test_training import tiny_config

    from coupled_qk_jax.training import loop

    cfg = tiny_config(tmp_path, steps=3)
    spec = CorpusSpec.coerce(cfg.data.corpus)
    spec = CorpusSpec("text_dir", path=spec.path, split_fractions=(0.6, 0.2, 0.2))
    manifest = prep.prepare(spec, tmp_path / "prepared", tokenizer="byte", shard_tokens=4000)
    assert len(manifest["splits"]["train"]["shards"]) >= 2
    cfg.data.update(corpus=f"tokens:{tmp_path / 'prepared'}", split_fractions="")

    def forbidden(*args, **kwargs):
        raise AssertionError("must not be called for a tokens: corpus")

    monkeypatch.setattr(token_cache, "file_sha256", forbidden)
    monkeypatch.setattr(prepared, "_sha256_of", forbidden)
    monkeypatch.setattr(loop, "shared_token_cache", forbidden)
    workdir = tmp_path / "run"
    summary = loop.train(cfg, str(workdir), progress=False)
    assert summary["status"] == "completed" and summary["step"] == 3 and np.isfinite(summary["train_loss"])
    data = json.loads((workdir / "data.json").read_text())
    assert data["corpus"]["kind"] == "tokens"
    for split in SPLITS:
        assert data["splits"][split]["tokens_sha256"] == manifest["splits"][split]["tokens_sha256"]
    assert [f[2] for f in data["sources"]["files"]] == [s["sha256"] for split in SPLITS
                                                        for s in manifest["splits"][split]["shards"]]
    np.testing.assert_array_equal(np.fromfile(workdir / "heldout" / "validation.bin", dtype=np.uint16),
                                  concatenated(tmp_path / "prepared", manifest, "validation"))
    assert not (tmp_path / "cache").exists()  # nothing was tokenised into the token cache


# One process of a 2-process (gloo) run: the data set-up train.py does before building the model (the run
# directory's checks, then load_data), with the token cache's entry point made to fail, then one collective that
# both processes must reach. train.py itself on 2 processes costs ~30 s here (start-up and compilation), too much
# for this file; this is what differs for a tokens: corpus.
_DATA_SETUP = """
import json, sys
from coupled_qk_jax.distributed import initialize_distributed
initialize_distributed(initialization_timeout=60)
import jax, numpy as np
from jax.experimental import multihost_utils
from coupled_qk_jax.configs.lm import get_config
from coupled_qk_jax.training import loop
from coupled_qk_jax.training.cli import config_json
from coupled_qk_jax.training.config import RunConfig
def forbidden(*args, **kwargs):
    raise AssertionError("tokenising")
loop.shared_token_cache = forbidden
cfg = get_config("coupled_euler,tiny")
cfg.model.vocab_size = 264
cfg.data.update(corpus="tokens:" + sys.argv[1], cache_dir=sys.argv[3], seq_len=32)
cache, fingerprint, _ = loop.prepare_data(RunConfig.from_configdict(cfg), json.loads(config_json(cfg)), sys.argv[2])
counts = multihost_utils.process_allgather(np.int64(cache.tokens("train").shape[0]))
print("LOADED", jax.process_index(), counts.tolist(), fingerprint["splits"]["train"]["tokens_sha256"])
"""


@pytest.mark.mesh
def test_two_processes_open_prepared_tokens_without_tokenising(tmp_path):
    """Both processes of a 2-process run set up the data of a tokens: corpus on their own (no token cache, no
    tokenising, no barrier around it) and then meet at a collective."""
    portpicker = pytest.importorskip("portpicker")
    from coupled_qk_jax import distributed
    from test_multihost import _env, join

    spec = write_corpus(tmp_path / "corpus")
    manifest = prep.prepare(spec, tmp_path / "prepared", tokenizer="byte", **SMALL)
    (tmp_path / "run").mkdir()
    port = portpicker.pick_unused_port()
    procs = []
    try:
        for pid in range(2):
            cluster = {distributed.ENV_COORDINATOR: f"127.0.0.1:{port}", distributed.ENV_NUM_PROCESSES: "2",
                       distributed.ENV_PROCESS_ID: str(pid)}
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _DATA_SETUP, str(tmp_path / "prepared"), str(tmp_path / "run"),
                 str(tmp_path / "cache")], cwd=ROOT, env=_env(1, cluster), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
    finally:
        outs = join(procs)
    n = manifest["splits"]["train"]["tokens"]
    for pid, out in enumerate(outs):
        loaded = [line.split() for line in out.splitlines() if line.startswith("LOADED")]
        assert loaded == [["LOADED", str(pid), f"[{n},", f"{n}]", manifest["splits"]["train"]["tokens_sha256"]]], out
    assert not (tmp_path / "cache").exists()
    assert json.loads((tmp_path / "run" / "data.json").read_text())["corpus"]["kind"] == "tokens"


def test_command_line_end_to_end(tmp_path):
    """python -m coupled_qk_jax.data.prepare in a subprocess writes what the function writes."""
    spec = write_corpus(tmp_path / "corpus")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "coupled_qk_jax.data.prepare", f"--corpus={spec}",
                        f"--out={tmp_path / 'cli'}", "--tokenizer=byte", "--workers=1", "--shard_tokens=700",
                        "--split_fractions=0.6,0.2,0.2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    want = prep.prepare(spec, tmp_path / "fn", tokenizer="byte", shard_tokens=700)
    assert json.loads((tmp_path / "cli" / "manifest.json").read_text()) == json.loads(json.dumps(want))
