"""Data layer: corpora, tokenizers, token cache, grain pipeline. Fast, offline; fixtures are written into tmp_path.

References are independent of the code under test: files are read back with plain ``open``, token streams are
rebuilt with ``tokenizer.encode`` one document at a time, and pipeline windows are checked against ``np.arange``
token arrays, where a window's contents name its own start position.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from coupled_qk_jax.errors import UserError

from coupled_qk_jax.data.corpora import (
    SPLITS, CorpusError, CorpusSpec, ReadStats, carve_fractions, iter_documents, list_files, split_of)
from coupled_qk_jax.data.pipeline import (
    IGNORE_INDEX, eval_batches, make_train_iterator, num_eval_batches, num_windows)
from coupled_qk_jax.data.token_cache import build_token_cache, load_token_cache, token_dtype
from coupled_qk_jax.data.tokenizer import BPETokenizer, ByteTokenizer

FRACTIONS = (0.6, 0.2, 0.2)
WORDS = ("the quick brown fox jumps over lazy dog attention query key value matrix gradient flow coupled "
         "token window corpus split train test validation def return class import self lambda yield").split()
NON_ASCII = "Grüße, 日本語のテキスト, emoji 🙂🚀, naïve café — ΑΒΓ δ\n\ttabs and  spaces"


def _text(rng: random.Random, n_words: int) -> str:
    lines = []
    for _ in range(max(1, n_words // 12)):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(12)) + rng.choice([".", ":", "()", ""]))
    return "\n".join(lines) + "\n"


def _write_corpus(root: Path, n_files: int = 40, n_words: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    for i in range(n_files):
        sub = root / f"part{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        ext = (".txt", ".md", ".rst", ".py")[i % 4]
        (sub / f"doc{i:03d}{ext}").write_text(_text(rng, n_words) + (NON_ASCII if i % 5 == 0 else ""),
                                              encoding="utf-8")
    return root


def _spec(root: Path) -> CorpusSpec:
    return CorpusSpec("text_dir", path=str(root), split_fractions=FRACTIONS)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def bpe(corpus_dir: Path) -> BPETokenizer:
    return BPETokenizer.train(iter_documents(_spec(corpus_dir), "train"), vocab_size=320)


# -- corpora ---------------------------------------------------------------------------------------------------------
def test_stdlib_split_is_deterministic_disjoint_and_complete():
    root = Path(sysconfig.get_paths()["stdlib"])
    per_split = {s: list_files("stdlib", s) for s in SPLITS}
    assert per_split == {s: list_files(CorpusSpec("stdlib"), s) for s in SPLITS}  # deterministic
    sets = [set(v) for v in per_split.values()]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    # Independent listing: every .py under the stdlib outside test folders and installed packages.
    excluded = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    expected = {p.relative_to(root).as_posix() for p in root.rglob("*.py")
                if not excluded & set(p.relative_to(root).parts[:-1])
                and not any(part.startswith(".") for part in p.relative_to(root).parts)}
    assert set().union(*sets) == expected
    assert all("test" not in Path(f).parts[:-1] for f in expected)
    n = len(expected)
    assert n > 300 and len(sets[0]) > 0.9 * n and len(sets[1]) >= 1 and len(sets[2]) >= 1


def test_split_of_a_file_does_not_move_when_files_are_added(tmp_path: Path):
    root = _write_corpus(tmp_path / "c", n_files=30)
    spec = _spec(root)
    before = {s: set(list_files(spec, s)) for s in SPLITS}
    _write_corpus(tmp_path / "c" / "more", n_files=30, seed=1)
    after = {s: set(list_files(spec, s)) for s in SPLITS}
    for s in SPLITS:
        assert before[s] <= after[s]
    assert sum(map(len, after.values())) == 60


def test_text_dir_documents_are_the_files_of_the_split(corpus_dir: Path):
    spec = _spec(corpus_dir)
    for split in SPLITS:
        files = list_files(spec, split)
        assert files, f"fixture should put files in {split}"
        expected = [(corpus_dir / f).read_text(encoding="utf-8") for f in sorted(files)]
        stats = ReadStats()
        assert list(iter_documents(spec, split, stats=stats)) == expected
        assert stats.documents == len(expected) and stats.bytes == sum(len(t.encode()) for t in expected)


def test_spec_string_and_dict_forms_round_trip(tmp_path: Path):
    for text in ["stdlib", f"text_dir:{tmp_path}", f"wikitext103:{tmp_path}", "hf:openwebtext",
                 "hf:Salesforce/wikitext:wikitext-103-raw-v1:text", f"mixture:stdlib@1;text_dir:{tmp_path}@2.5"]:
        spec = CorpusSpec.parse(text)
        assert CorpusSpec.parse(str(spec)) == spec
        assert CorpusSpec.coerce(json.loads(json.dumps(spec.to_dict()))).to_dict() == spec.to_dict()
    with pytest.raises(CorpusError, match="cannot parse corpus spec 'books:/x'"):
        CorpusSpec.parse("books:/x")
    with pytest.raises(CorpusError, match="unknown corpus kind"):
        CorpusSpec("books")
    with pytest.raises(CorpusError, match="lacks a weight"):
        CorpusSpec.parse("mixture:stdlib")


def test_errors_missing_and_empty_dir(tmp_path: Path):
    with pytest.raises(CorpusError, match="does not exist"):
        list(iter_documents(CorpusSpec("text_dir", path=str(tmp_path / "nope")), "train"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.bin").write_bytes(b"\x00\x01")
    with pytest.raises(CorpusError, match="has no .txt/.md/.rst/.py files"):
        list(iter_documents(CorpusSpec("text_dir", path=str(tmp_path / "empty")), "train"))
    with pytest.raises(CorpusError, match="unknown split"):
        list(iter_documents("stdlib", "dev"))
    err = CorpusError("x")
    assert isinstance(err, ValueError)


@pytest.mark.filterwarnings("ignore:.*is empty")
def test_non_utf8_file_is_skipped_and_counted(tmp_path: Path):
    root = _write_corpus(tmp_path / "c", n_files=12)
    spec = CorpusSpec("text_dir", path=str(root), split_fractions=(1.0, 0.0, 0.0))
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    stats = ReadStats()
    with pytest.warns(UserWarning, match="skipped 1 non-UTF-8 file"):
        docs = list(iter_documents(spec, "train", stats=stats))
    assert stats.skipped_non_utf8 == ["latin1.txt"]
    assert len(docs) == 12
    with pytest.warns(UserWarning, match="non-UTF-8"):
        cache = build_token_cache(spec, tmp_path / "cache", tokenizer="byte", vocab_size=257)
    assert cache.manifest["splits"]["train"]["skipped_non_utf8"] == 1
    assert cache.manifest["splits"]["train"]["documents"] == 12


def test_wikitext_missing_and_present(tmp_path: Path):
    with pytest.raises(CorpusError, match=r"wiki\.train\.raw.*datasets"):
        list(iter_documents(f"wikitext103:{tmp_path}", "train"))
    body = {"train": " = Alpha = \n\n Alpha text .\n\n = = Section = = \n more .\n = Beta = \n\n Beta text .\n",
            "validation": " = Gamma = \n\n g .\n", "test": " = Delta = \n\n d .\n"}
    for split, fn in (("train", "wiki.train.raw"), ("validation", "wiki.valid.raw"), ("test", "wiki.test.raw")):
        (tmp_path / fn).write_text(body[split], encoding="utf-8")
    docs = list(iter_documents(f"wikitext103:{tmp_path}", "train"))
    assert docs == [" = Alpha = \n\n Alpha text .\n\n = = Section = = \n more .\n", " = Beta = \n\n Beta text .\n"]
    assert "".join(docs) == body["train"]
    assert list(iter_documents(f"wikitext103:{tmp_path}", "validation")) == [body["validation"]]


# -- Hugging Face datasets (the [hf] extra): local formats built here, offline behaviour -----------------------------
HF_ROWS = {split: [f"{split} row {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(30)) + "\n"
                   for i in range(n)] for split, n in (("train", 24), ("validation", 5), ("test", 4))}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Corpus strings of one three-split dataset in every local layout docs/data.md lists (rows = HF_ROWS)."""
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("hf")
    (root / "parquet").mkdir()
    (root / "arrow").mkdir()
    (root / "snapshot" / "wikitext-103-raw-v1").mkdir(parents=True)
    for split, rows in HF_ROWS.items():
        table = pa.table({"id": list(range(len(rows))), "text": rows})
        pq.write_table(table, root / "parquet" / f"{split}.parquet")
        pq.write_table(table, root / "snapshot" / "wikitext-103-raw-v1" / f"{split}-00000-of-00001.parquet")
        with pa.ipc.new_stream(str(root / "arrow" / f"{split}.arrow"), table.schema) as w:
            w.write_table(table)
    datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": r}) for s, r in HF_ROWS.items()}).save_to_disk(
        str(root / "disk"))
    return {"parquet": f"hf:{root / 'parquet'}", "arrow": f"hf:{root / 'arrow'}", "save_to_disk": f"hf:{root / 'disk'}",
            "hub snapshot": f"hf:{root / 'snapshot'}:wikitext-103-raw-v1:text"}


@pytest.mark.parametrize("layout", ["parquet", "arrow", "save_to_disk", "hub snapshot"])
def test_hf_local_layouts_end_to_end(hf_dirs: dict[str, str], layout: str, tmp_path: Path):
    spec = CorpusSpec.parse(hf_dirs[layout])
    for split in SPLITS:
        assert list(iter_documents(spec, split)) == HF_ROWS[split]
    cache = build_token_cache(spec, tmp_path, tokenizer="byte", vocab_size=257)
    for split in SPLITS:  # every row, then <|endoftext|> (256), in the file's order
        expected = np.concatenate([np.append(np.frombuffer(r.encode(), np.uint8), 256) for r in HF_ROWS[split]])
        np.testing.assert_array_equal(cache.tokens(split), expected)


def test_hf_single_file_carves_splits_and_changes_rebuild_the_cache(hf_dirs: dict[str, str], tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "only_train.parquet"
    pq.write_table(pa.table({"body": HF_ROWS["train"]}), path)
    spec = CorpusSpec("hf", name=str(path), text_field="body", split_fractions=(0.5, 0.25, 0.25))
    got = {s: list(iter_documents(spec, s)) for s in SPLITS}
    assert sorted(sum(got.values(), [])) == sorted(HF_ROWS["train"])  # each row in exactly one split
    assert got == {s: [r for i, r in enumerate(HF_ROWS["train"]) if split_of(f"row/{i}", (0.5, 0.25, 0.25)) == s]
                   for s in SPLITS}
    assert all(got.values())
    # With its own validation split, only test is carved: train's rows split 2:1 into train and test.
    assert carve_fractions({"train", "validation"}, (0.5, 0.25, 0.25)) == pytest.approx((2 / 3, 0.0, 1 / 3))
    assert carve_fractions({"train", "validation", "test"}, (0.5, 0.25, 0.25)) is None
    first = build_token_cache(spec, tmp_path / "cache", tokenizer="byte", vocab_size=257)
    n_docs = sum(first.manifest["splits"][s]["documents"] for s in SPLITS)
    pq.write_table(pa.table({"body": HF_ROWS["train"][:12]}), path)  # halve the file: the cache must notice
    second = build_token_cache(spec, tmp_path / "cache", tokenizer="byte", vocab_size=257)
    assert n_docs == 24 and sum(second.manifest["splits"][s]["documents"] for s in SPLITS) == 12
    with pytest.raises(CorpusError, match="no text field 'text'; fields: \\['body'\\]"):
        list(iter_documents(CorpusSpec("hf", name=str(path)), "train"))


def test_hf_offline_fails_fast_in_one_line():
    pytest.importorskip("datasets")
    code = ("from coupled_qk_jax.data.corpora import CorpusError, iter_documents\n"
            "try:\n    list(iter_documents('hf:nobody-has/this-dataset-xyz', 'train'))\n"
            "except CorpusError as e:\n    print('ERR', e)\n")
    root = Path(__file__).resolve().parents[1]
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)})
    elapsed = time.perf_counter() - t0
    lines = [x for x in out.stdout.splitlines() if x.startswith("ERR")]
    assert len(lines) == 1 and "HF_HUB_OFFLINE is set" in lines[0], out.stdout + out.stderr[-2000:]
    assert elapsed < 60, f"took {elapsed:.0f} s: offline mode must not wait for network retries"


def test_hf_without_datasets_is_a_clear_error(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(CorpusError, match=r"pip install datasets \(or pip install -e \"\.\[hf\]\"\)"):
        list(iter_documents("hf:openwebtext", "train"))


def test_mixture_weights_and_membership(tmp_path: Path):
    a = _write_corpus(tmp_path / "a", n_files=30, n_words=400, seed=1)
    b = _write_corpus(tmp_path / "b", n_files=10, n_words=400, seed=2)
    sa = CorpusSpec("text_dir", path=str(a), split_fractions=(1.0, 0.0, 0.0))
    sb = CorpusSpec("text_dir", path=str(b), split_fractions=(1.0, 0.0, 0.0))
    docs_a, docs_b = list(iter_documents(sa, "train")), list(iter_documents(sb, "train"))
    mix = CorpusSpec("mixture", sources=((sa, 1.0), (sb, 1.0)))
    out = list(iter_documents(mix, "train"))
    assert out == list(iter_documents(mix, "train"))  # deterministic order
    from_a = [d for d in out if d in docs_a]
    from_b = [d for d in out if d in docs_b]
    assert len(from_a) + len(from_b) == len(out)
    assert sorted(from_b) == sorted(docs_b)  # the scarce source is used whole, nothing repeated
    bytes_a, bytes_b = (sum(len(d.encode()) for d in x) for x in (from_a, from_b))
    assert abs(bytes_a - bytes_b) / bytes_b < 0.15  # 1:1 weights -> about equal bytes (whole documents)
    assert out != from_a + from_b  # interleaved, not concatenated


# -- tokenizers ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["plain ASCII text, with  two spaces\nand a newline.", NON_ASCII, " leading", ""])
def test_tokenizer_round_trip(bpe: BPETokenizer, text: str):
    byte = ByteTokenizer()
    assert list(byte.encode(text)) == list(text.encode("utf-8"))
    assert byte.decode(byte.encode(text)) == text
    assert bpe.decode(bpe.encode(text)) == text
    assert [list(x) for x in bpe.encode_batch([text, text])] == [list(bpe.encode(text))] * 2


def test_bpe_properties_and_save_load(bpe: BPETokenizer, tmp_path: Path):
    assert bpe.vocab_size == 320 and bpe.eot_id == 0 and ByteTokenizer().eot_id == 256
    ids = bpe.encode("the quick brown fox jumps over the lazy dog")
    assert len(ids) < 0.7 * len("the quick brown fox jumps over the lazy dog")  # merges learned from the fixture
    assert 0 <= ids.min() and ids.max() < 320
    bpe.save(tmp_path / "tok.json")
    again = BPETokenizer.load(tmp_path / "tok.json", vocab_size=320)
    assert list(again.encode(NON_ASCII)) == list(bpe.encode(NON_ASCII))
    with pytest.raises(CorpusError, match="vocab mismatch"):
        BPETokenizer.load(tmp_path / "tok.json", vocab_size=512)


def test_bpe_too_small_corpus_is_a_clear_error():
    with pytest.raises(CorpusError, match="too small"):
        BPETokenizer.train(["tiny text"], vocab_size=4096)


# -- token cache -----------------------------------------------------------------------------------------------------
def test_token_cache_contents_manifest_and_reuse(corpus_dir: Path, tmp_path: Path):
    spec = _spec(corpus_dir)
    cache = build_token_cache(spec, tmp_path, tokenizer="bpe", vocab_size=320)
    m = cache.manifest
    assert m["dtype"] == "uint16" and m["tokenizer"] == {**m["tokenizer"], "kind": "bpe", "vocab_size": 320,
                                                         "eot_id": 0}
    assert m["corpus"]["kind"] == "text_dir" and m["corpus"]["path"] == os.path.abspath(corpus_dir)
    assert cache.directory.parent == tmp_path / "tokens" and cache.directory.name == f"text_dir-{m['key']}"
    assert (cache.directory / "tokenizer.json").is_file()
    tok = cache.tokenizer
    for split in SPLITS:
        docs = [(corpus_dir / f).read_text(encoding="utf-8") for f in list_files(spec, split)]
        expected = np.concatenate([np.append(tok.encode(d), tok.eot_id) for d in docs])
        got = cache.tokens(split)
        assert got.dtype == np.uint16 and isinstance(got, np.memmap)
        np.testing.assert_array_equal(got, expected)
        entry = m["splits"][split]
        assert entry["tokens"] == expected.size and entry["documents"] == len(docs)
        assert entry["files"] == len(docs) and len(entry["text_sha256"]) == 64
        assert len(entry["file_list_sha256"]) == 64 and entry["skipped_non_utf8"] == 0
    on_disk = json.loads((cache.directory / "manifest.json").read_text())
    assert on_disk == m

    # Reuse: same spec -> same entry, nothing rewritten.
    mtime = (cache.directory / "train.bin").stat().st_mtime_ns
    again = build_token_cache(spec, tmp_path, tokenizer="bpe", vocab_size=320)
    assert again.directory == cache.directory and again.manifest == m
    assert (cache.directory / "train.bin").stat().st_mtime_ns == mtime
    assert load_token_cache(cache.directory).manifest == m
    # A different tokenizer setting is a different entry.
    byte = build_token_cache(spec, tmp_path, tokenizer="byte", vocab_size=257)
    assert byte.directory != cache.directory
    assert byte.manifest["splits"]["train"]["tokens"] == sum(
        len((corpus_dir / f).read_bytes()) + 1 for f in list_files(spec, "train"))
    assert not list(tmp_path.rglob(".*tmp*"))  # no temporary files left behind


@pytest.mark.filterwarnings("ignore:.*is empty")
def test_token_cache_rebuilds_when_corpus_changes(tmp_path: Path):
    root = _write_corpus(tmp_path / "c", n_files=8)
    spec = CorpusSpec("text_dir", path=str(root), split_fractions=(1.0, 0.0, 0.0))
    first = build_token_cache(spec, tmp_path / "cache", tokenizer="byte", vocab_size=257)
    n0 = first.manifest["splits"]["train"]["tokens"]
    (root / "new.txt").write_text("extra document\n", encoding="utf-8")
    second = build_token_cache(spec, tmp_path / "cache", tokenizer="byte", vocab_size=257)
    assert second.directory == first.directory
    assert second.manifest["splits"]["train"]["tokens"] == n0 + len("extra document\n") + 1


FINAL_NAMES = ("tokenizer.json", "train.bin", "validation.bin", "test.bin", "manifest.json")  # in writing order


def _entry_files(cache_root: Path) -> dict[str, list[str]]:
    """{entry directory: sorted file names} under CACHE/tokens, temporary files included."""
    return {d.name: sorted(f.name for f in d.iterdir()) for d in (cache_root / "tokens").iterdir() if d.is_dir()}


def test_token_cache_crash_mid_file_leaves_nothing_under_a_final_name(corpus_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """The tokeniser fails after part of train.bin is on disk (at its third chunk of documents): no train.bin, no
    manifest and no temporary file remain. Positive controls: the partial file did exist, under its temporary name,
    when the fault struck, and the same build without the fault completes."""
    from coupled_qk_jax.data import token_cache

    monkeypatch.setattr(token_cache, "_ENCODE_CHUNK_BYTES", 2000)  # many chunks per split
    real, calls, partial = ByteTokenizer.encode_batch, [], []

    def crash_at_third_chunk(self, texts):
        calls.append(len(texts))
        if len(calls) == 3:
            partial.extend((p.name, p.stat().st_size) for p in (tmp_path / "tokens").rglob("*train.bin*"))
            raise OSError("simulated crash while tokenising")
        return real(self, texts)

    monkeypatch.setattr(ByteTokenizer, "encode_batch", crash_at_third_chunk)
    with pytest.raises(OSError, match="simulated crash"):
        build_token_cache(_spec(corpus_dir), tmp_path, tokenizer="byte", vocab_size=257)
    assert len(partial) == 1 and partial[0][0].startswith(".train.bin.tmp") and partial[0][1] > 0, partial
    assert list(_entry_files(tmp_path).values()) == [[]]  # nothing under a final name, no temporary file
    monkeypatch.setattr(ByteTokenizer, "encode_batch", real)
    cache = build_token_cache(_spec(corpus_dir), tmp_path, tokenizer="byte", vocab_size=257)
    assert sorted(p.name for p in cache.directory.iterdir()) == sorted(FINAL_NAMES[1:])


@pytest.mark.parametrize("crash_at", range(len(FINAL_NAMES) + 1))
def test_token_cache_crash_before_a_rename_leaves_no_partial_entry(corpus_dir: Path, bpe: BPETokenizer,
                                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    crash_at: int):
    """Each file is fsynced just before its rename: a crash there (the bytes written, not yet in place) leaves
    the earlier files complete under their final names, nothing of this one (its temporary file removed) and no
    manifest, so the entry counts as absent. A rebuild over a complete entry first removes its manifest:
    failing half-way it leaves an incomplete entry, never the old manifest over new files. crash_at = 5: no crash
    (the positive control: every file in place)."""
    from coupled_qk_jax.data.token_cache import find_token_cache

    bpe.save(tmp_path / "given.json")
    kwargs = dict(tokenizer="bpe", vocab_size=320, tokenizer_path=str(tmp_path / "given.json"))
    complete = build_token_cache(_spec(corpus_dir), tmp_path / "cache", **kwargs)
    assert find_token_cache(_spec(corpus_dir), tmp_path / "cache", **kwargs) is not None
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == crash_at + 1:
            raise OSError("simulated crash before the rename")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    for root, extra in ((tmp_path / "fresh", {}), (tmp_path / "cache", {"rebuild": True})):
        calls.clear()
        if crash_at < len(FINAL_NAMES):
            # the manifest goes through paths.write_json, which names the file in a one-line UserError
            with pytest.raises((OSError, UserError), match="simulated crash"):
                build_token_cache(_spec(corpus_dir), root, **kwargs, **extra)
        else:
            build_token_cache(_spec(corpus_dir), root, **kwargs, **extra)
        names = list(_entry_files(root).values())[0]
        if root.name == "fresh":
            assert names == sorted(FINAL_NAMES[:crash_at])  # the files renamed before the crash, nothing else
        else:  # the old entry's files stay, but without a manifest unless the rebuild finished
            expected = set(FINAL_NAMES) - ({"manifest.json"} if crash_at < len(FINAL_NAMES) else set())
            assert names == sorted(expected)
        found = find_token_cache(_spec(corpus_dir), root, **kwargs)
        assert (found is not None) == (crash_at == len(FINAL_NAMES))
    assert complete.directory.name == list(_entry_files(tmp_path / "cache"))[0]


def test_token_cache_vocab_mismatch(corpus_dir: Path, bpe: BPETokenizer, tmp_path: Path):
    bpe.save(tmp_path / "tok.json")
    with pytest.raises(CorpusError, match="vocab mismatch.*320 tokens, more than model.vocab_size 300"):
        build_token_cache(_spec(corpus_dir), tmp_path / "cache", vocab_size=300, tokenizer_path=str(tmp_path / "tok.json"))
    with pytest.raises(CorpusError, match="vocab mismatch"):
        build_token_cache(_spec(corpus_dir), tmp_path / "cache", tokenizer="byte", vocab_size=256)
    # A cached tokenizer.json that no longer matches its manifest is refused, not silently used.
    cache = build_token_cache(_spec(corpus_dir), tmp_path / "cache", vocab_size=320,
                              tokenizer_path=str(tmp_path / "tok.json"))
    BPETokenizer.train(iter_documents(_spec(corpus_dir), "train"), 300).save(cache.directory / "tokenizer.json")
    with pytest.raises(CorpusError, match="vocab mismatch"):
        load_token_cache(cache.directory)
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32


# -- pipeline --------------------------------------------------------------------------------------------------------
def _check_windows(batch: dict[str, np.ndarray], seq_len: int) -> np.ndarray:
    """With tokens = arange(N) and no bos, window k is inputs arange(kT, kT + T), targets + 1 (IGNORE_INDEX past the
    end of the split); returns the window indices k."""
    x, y = batch["inputs"], batch["targets"]
    assert x.dtype == np.int32 and y.dtype == np.int32 and x.shape == y.shape and x.shape[1] == seq_len
    k = x[:, 0] // seq_len
    assert (x[:, 0] % seq_len == 0).all()
    valid = y != IGNORE_INDEX
    np.testing.assert_array_equal(x[valid], (k[:, None] * seq_len + np.arange(seq_len))[valid])
    np.testing.assert_array_equal(y[valid], x[valid] + 1)
    return k


def test_train_batches_deterministic_and_seed_dependent():
    tokens = np.arange(5000, dtype=np.int32)
    take = lambda seed: [next(it) for it in [make_train_iterator(tokens, 32, 4, seed)] for _ in range(10)]
    a, b, c = take(0), take(0), take(1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"], y["targets"])
    assert any(not np.array_equal(x["inputs"], z["inputs"]) for x, z in zip(a, c))
    for batch in a:
        assert (_check_windows(batch, 32) < num_windows(5000, 32)).all()


@pytest.mark.parametrize("n, seq_len, batch, bos", [(1009, 16, 3, 5000), (1009, 16, 4, None), (97, 10, 4, 5000)])
def test_train_epoch_makes_every_token_a_target_exactly_once(n: int, seq_len: int, batch: int, bos: int | None):
    """Through the real iterator, on a split whose size is a prime (no multiple of T or B): the first W windows
    (one epoch; batches may straddle epochs) score each token exactly once; the next epoch is another order."""
    tokens = np.arange(n, dtype=np.uint16)  # token value = its position
    w = num_windows(n, seq_len, bos_id=bos)
    assert w == math.ceil((n if bos is not None else n - 1) / seq_len)
    it = make_train_iterator(tokens, seq_len, batch, seed=3, bos_id=bos, num_threads=1)
    rows_x, rows_y = [], []
    while len(rows_y) < 2 * w:
        b = next(it)
        rows_x += list(b["inputs"])
        rows_y += list(b["targets"])
    epochs = [np.stack(rows_y[:w]), np.stack(rows_y[w:2 * w])]
    for y in epochs:
        targets = np.sort(y[y != IGNORE_INDEX])
        np.testing.assert_array_equal(targets, np.arange(0 if bos is not None else 1, n))  # each exactly once
        assert (y == IGNORE_INDEX).sum() == w * seq_len - targets.size  # only the last window is padded
    firsts = [np.stack(rows_x[:w])[:, 0], np.stack(rows_x[w:2 * w])[:, 0]]
    assert not np.array_equal(firsts[0], firsts[1])  # reshuffled each epoch
    if bos is not None:  # the window of the split's first token starts with the separator, as in evaluation
        assert any(r[0] == bos and t[0] == 0 for r, t in zip(rows_x[:w], rows_y[:w]))


def test_hosts_read_their_rows_of_the_single_host_batches():
    """Hosts whose rows of the global batch are not one block (as on TPU pods, sharding.host_batch_rows): each
    reads exactly those rows of the single-host batch, so together they read disjoint windows covering the epoch."""
    tokens = np.arange(4001, dtype=np.int32)
    seq_len, windows = 25, num_windows(4001, 25)  # 160 windows
    rows = {0: [0, 1, 4], 1: [2, 3, 5]}
    single = make_train_iterator(tokens, seq_len, 6, seed=7)
    hosts = {h: make_train_iterator(tokens, seq_len, 6, seed=7, rows=r) for h, r in rows.items()}
    seen = {0: [], 1: []}
    for _ in range(windows // 6):  # one epoch, less the windows of the batch that straddles the next one
        ref = _check_windows(next(single), seq_len)
        for h, it in hosts.items():
            part = _check_windows(next(it), seq_len)
            np.testing.assert_array_equal(part, ref[rows[h]])
            seen[h] += part.tolist()
    assert not set(seen[0]) & set(seen[1])
    assert len(set(seen[0] + seen[1])) == windows // 6 * 6


def test_a_stream_started_at_batch_k_is_the_uninterrupted_stream_from_k():
    """The data position of a resumed run is its step: the stream started at batch k (any host's rows) is the one
    that went through the first k batches, across epoch boundaries (15 windows, 5 batches per epoch here)."""
    tokens = np.arange(300, dtype=np.uint16)
    it = make_train_iterator(tokens, 20, 3, seed=11)
    expected = [next(it) for _ in range(19)][7:]
    for rows in (None, [0, 2], [1]):
        fresh = make_train_iterator(tokens, 20, 3, seed=11, rows=rows, start=7)
        take = slice(None) if rows is None else rows
        for e in expected:
            g = next(fresh)
            np.testing.assert_array_equal(g["inputs"], e["inputs"][take])
            np.testing.assert_array_equal(g["targets"], e["targets"][take])


@pytest.mark.parametrize("n,seq_len,batch,bos", [(1000, 32, 4, None), (1000, 32, 4, 7), (97, 10, 3, 7),
                                                 (64, 64, 2, None), (5, 8, 2, 7)])
def test_eval_windows_score_every_token_once(n: int, seq_len: int, batch: int, bos: int | None):
    tokens = np.arange(100, 100 + n, dtype=np.uint16)
    scored: list[int] = []
    batches = list(eval_batches(tokens, seq_len, batch, bos_id=bos))
    assert len(batches) == num_eval_batches(n, seq_len, batch, bos_id=bos)
    for b in batches:
        x, y = b["inputs"], b["targets"]
        assert x.shape == y.shape == (batch, seq_len) and x.dtype == y.dtype == np.int32
        valid = y != IGNORE_INDEX
        scored += y[valid].tolist()
        # Where both are real, the next input is this position's target (contiguous text).
        both = valid[:, :-1] & valid[:, 1:]
        np.testing.assert_array_equal(x[:, 1:][both], y[:, :-1][both])
    expected = tokens.tolist() if bos is not None else tokens[1:].tolist()
    assert scored == expected  # each token exactly once, in order
    if bos is not None:
        assert batches[0]["inputs"][0, 0] == bos


def test_eval_windows_across_hosts():
    """Three hosts holding interleaved rows of a batch of 6: the same number of batches on each, every token scored
    once over the hosts, and row r of batch b is window 6b + r of the stream [0] + tokens."""
    tokens = np.arange(10, 1010, dtype=np.int32)
    rows = [[0, 3], [1, 4], [2, 5]]
    per_host = [list(eval_batches(tokens, 16, 6, bos_id=0, rows=r)) for r in rows]
    assert len({len(b) for b in per_host}) == 1  # same number of steps on every host
    assert len(per_host[0]) == math.ceil(1000 / 16 / 6)
    scored = sorted(v for bs in per_host for b in bs for v in b["targets"][b["targets"] != IGNORE_INDEX].tolist())
    assert scored == tokens.tolist()
    stream = np.concatenate([[0], tokens])
    for r, batches in zip(rows, per_host):
        for b, batch in enumerate(batches):
            for i, row in enumerate(r):
                start = (6 * b + row) * 16
                real = stream[start:start + 16]  # the last window is padded with inputs 0
                np.testing.assert_array_equal(batch["inputs"][i][:real.size], real)
                assert not batch["inputs"][i][real.size:].any()


def test_pipeline_errors():
    tokens = np.arange(100, dtype=np.int32)
    with pytest.raises(CorpusError, match="training split has 1 token"):
        make_train_iterator(tokens[:1], 100, 2, seed=0)
    with pytest.raises(CorpusError, match="nothing to evaluate"):
        next(eval_batches(np.zeros(0, np.uint16), 8, 2))
    with pytest.raises(CorpusError, match="rows must be ascending"):
        make_train_iterator(tokens, 8, 2, seed=0, rows=[2])
    with pytest.raises(CorpusError, match="rows must be ascending"):
        next(eval_batches(tokens, 8, 4, rows=[1, 0]))
    with pytest.raises(CorpusError, match="1-D"):
        make_train_iterator(tokens.reshape(10, 10), 4, 2, seed=0)


def test_end_to_end_cache_to_batches(corpus_dir: Path, tmp_path: Path):
    cache = build_token_cache(_spec(corpus_dir), tmp_path, tokenizer="byte", vocab_size=257)
    train = cache.tokens("train")
    it = make_train_iterator(train, 64, 8, seed=0)
    b = next(it)
    assert b["inputs"].shape == (8, 64) and b["inputs"].max() < cache.vocab_size
    # Each full row is a contiguous slice of the memmapped split.
    flat = np.asarray(train, dtype=np.int32)
    for row_x, row_y in zip(b["inputs"], b["targets"]):
        if (row_y == IGNORE_INDEX).any():  # the epoch's one partly padded window
            continue
        starts = np.flatnonzero(flat[: flat.size - 64] == row_x[0])
        assert any(np.array_equal(flat[s:s + 64], row_x) and np.array_equal(flat[s + 1:s + 65], row_y)
                   for s in starts)
    val = cache.tokens("validation")
    scored = sum(int((bb["targets"] != IGNORE_INDEX).sum())
                 for bb in eval_batches(val, 64, 8, bos_id=cache.eot_id))
    assert scored == val.size == cache.manifest["splits"]["validation"]["tokens"]


def test_gather_pickles_memmap_by_reference(tmp_path: Path):
    """The batch gather must travel to grain worker processes without copying the split into the pickle."""
    import pickle

    from coupled_qk_jax.data.pipeline import _Gather

    arr = np.arange(200_000, dtype=np.uint16)
    arr.tofile(tmp_path / "t.bin")
    mm = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r", shape=(200_000,))
    blob = pickle.dumps(_Gather(mm, 8))
    assert len(blob) < 10_000  # the 400 kB array is not inside
    out = pickle.loads(blob)(np.array([5, 125]))  # window indices
    np.testing.assert_array_equal(out["inputs"], np.stack([np.arange(40, 48), np.arange(1000, 1008)]))
    np.testing.assert_array_equal(out["targets"], out["inputs"] + 1)
