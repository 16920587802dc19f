"""GLUE data and metrics (coupled_qk_jax/data/glue.py). Numpy only, no JAX; fixtures are tiny files in tmp_path.

References are independent of the code under test: the TSV fixtures are written in GLUE's real layouts (CoLA's
headerless train/dev, MRPC's byte-order mark, MNLI's two dev files) and their expected contents are spelled out
literally; token rows are counted by hand from the byte tokenizer (ids = UTF-8 bytes, end-of-text = 256); metric
values are worked out by hand in comments; submissions are read back with plain ``open``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest

from coupled_qk_jax.data.glue import (
    TASKS,
    GlueExamples,
    accuracy,
    encode,
    f1,
    get_task,
    load_examples,
    matthews_corrcoef,
    parse_source,
    pearson,
    read_tsv,
    score,
    spearman,
    truncated_lengths,
    write_submission,
)
from coupled_qk_jax.data.tokenizer import ByteTokenizer
from coupled_qk_jax.errors import UserError

E = 256  # ByteTokenizer's end-of-text id


def _write(path: Path, rows: list[list[str]], bom: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join("\t".join(r) + "\n" for r in rows)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))


def _read(path: Path) -> str:
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def _one_line_error(excinfo: pytest.ExceptionInfo[UserError]) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------------------------- fixtures

MNLI_DEV_HEADER = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                   "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "label2", "label3",
                   "label4", "label5", "gold_label"]
MNLI_TEST_HEADER = MNLI_DEV_HEADER[:10]
MNLI_MATCHED = [("The new rights are nice enough", "Everyone really likes the newest benefits ", "neutral"),
                ("This site includes a list of all award winners.", ("The Government Executive articles housed on "
                  "the website are not able to be searched."), "contradiction"),
                ('He said "yes, that\'s right.', "He agreed.", "entailment")]
MNLI_MISMATCHED = [("Your gift is appreciated by each and every student.", "Hundreds of students will benefit.",
                    "contradiction"),
                   ("yeah well that's true", "That is correct.", "entailment")]


def _mnli_row(i: int, a: str, b: str, gold: str | None) -> list[str]:
    row = [str(i), str(1000 + i), f"{1000 + i}n", "government", f"( {a} )", f"( {b} )", f"(ROOT {a})",
           f"(ROOT {b})", a, b]
    return row if gold is None else row + [gold, gold, gold, "neutral", gold, gold]


@pytest.fixture
def glue_dir(tmp_path: Path) -> Path:
    """A glue_data folder with every task's files in GLUE's download layout (a few rows each)."""
    root = tmp_path / "glue_data"
    # CoLA: train/dev headerless (source, label, original mark, sentence); test has a header.
    _write(root / "CoLA/train.tsv", [["gj04", "1", "", "Our friends won't buy this analysis."],
                                     ["gj04", "0", "*", "They drank the pub."]])
    _write(root / "CoLA/dev.tsv", [["gj04", "1", "", "The sailors rode the breeze clear of the rocks."],
                                   ["gj04", "0", "*", "One more pseudo generalization and I'm giving up."],
                                   ["cj99", "1", "", 'He said "hi.']])
    _write(root / "CoLA/test.tsv", [["index", "sentence"], ["0", "Bill whistled past the house."],
                                    ["1", "The car honked its way down the road."]])
    _write(root / "SST-2/dev.tsv", [["sentence", "label"], ["it 's a charming and often affecting journey . ", "1"],
                                    ["unflinchingly bleak and desperate ", "0"]])
    _write(root / "SST-2/test.tsv", [["index", "sentence"], ["0", "uneasy mishmash of styles and genres ."]])
    mrpc_header = ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]
    _write(root / "MRPC/train.tsv", [mrpc_header,
                                     ["1", "702876", "702977", 'Amrozi called him " the witness " .',
                                      'Referring to him as " the witness " , Amrozi spoke .'],
                                     ["0", "2108705", "2108831", "Yucaipa owned Dominick 's .",
                                      "Yucaipa bought Dominick 's in 1995 ."]], bom=True)
    _write(root / "MRPC/test.tsv", [["index", "#1 ID", "#2 ID", "#1 String", "#2 String"],
                                    ["0", "1089874", "1089925", "PCCW 's chief will be leaving .",
                                     "The chief of PCCW is leaving ."]])
    stsb_header = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1",
                   "sentence2", "score"]
    _write(root / "STS-B/dev.tsv", [stsb_header,
                                    ["0", "main-captions", "MSRvid", "2012test", "0000", "none", "none",
                                     "A man with a hard hat is dancing.", "A man wearing a hard hat is dancing.",
                                     "5.000"],
                                    ["1", "main-captions", "MSRvid", "2012test", "0002", "none", "none",
                                     "A young child is riding a horse.", "A child is riding a horse.", "4.750"]])
    _write(root / "STS-B/test.tsv", [stsb_header[:-1],
                                     ["0", "main-captions", "MSRvid", "2012test", "0024", "none", "none",
                                      "A girl is styling her hair.", "A girl is brushing her hair."]])
    _write(root / "QQP/dev.tsv", [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
                                  ["201359", "303345", "303346", "Why are African-Americans so beautiful?",
                                   "Why are hispanics so beautiful?", "0"],
                                  ["226", "452", "453", "How do I learn Python?", "How can I learn Python?",
                                   "1"]])
    _write(root / "QQP/test.tsv", [["id", "question1", "question2"],
                                   ["7", "Is it ok?", 'Is "it" ok?']])
    _write(root / "MNLI/dev_matched.tsv",
           [MNLI_DEV_HEADER] + [_mnli_row(i, a, b, g) for i, (a, b, g) in enumerate(MNLI_MATCHED)])
    _write(root / "MNLI/dev_mismatched.tsv",
           [MNLI_DEV_HEADER] + [_mnli_row(i, a, b, g) for i, (a, b, g) in enumerate(MNLI_MISMATCHED)])
    _write(root / "MNLI/test_matched.tsv",
           [MNLI_TEST_HEADER, _mnli_row(10, "Hierbas, ans seco.", "Hierbas is a name.", None),
            _mnli_row(11, "The extent was low.", "It was low.", None)])
    _write(root / "QNLI/dev.tsv", [["index", "question", "sentence", "label"],
                                   ["0", "What came into force after the new constitution was herald?",
                                    "As of that day, the new constitution came into force.", "entailment"],
                                   ["1", "What is the first major city in the stream of the Rhine?",
                                    "The most important tributaries are the Ill and the Neckar.", "not_entailment"]])
    _write(root / "RTE/dev.tsv", [["index", "sentence1", "sentence2", "label"],
                                  ["0", "Dana Reeve, the widow of the actor, has died.", "Christopher Reeve had an accident.", "not_entailment"],
                                  ["1", "Yet, we now are discovering it.", "Bacteria is winning.", "entailment"]])
    _write(root / "WNLI/dev.tsv", [["index", "sentence1", "sentence2", "label"],
                                   ["0", "The drain is clogged with hair. It has to be cleaned.",
                                    "The hair has to be cleaned.", "0"],
                                   ["1", "Jane knocked on Susan's door but she did not answer.",
                                    "Susan did not answer.", "1"]])
    return root


# ---------------------------------------------------------------------------------------------- tasks


def test_task_table() -> None:
    assert list(TASKS) == ["cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli"]
    expected = {  # name: (metrics, main, pair, labels, submission files)
        "cola": (("matthews_corrcoef",), "matthews_corrcoef", False, ("0", "1"), ("CoLA.tsv",)),
        "sst2": (("accuracy",), "accuracy", False, ("0", "1"), ("SST-2.tsv",)),
        "mrpc": (("f1", "accuracy"), "f1", True, ("0", "1"), ("MRPC.tsv",)),
        "stsb": (("pearson", "spearman"), "spearman", True, (), ("STS-B.tsv",)),
        "qqp": (("f1", "accuracy"), "f1", True, ("0", "1"), ("QQP.tsv",)),
        "mnli": (("accuracy",), "accuracy", True, ("contradiction", "entailment", "neutral"),
                 ("MNLI-m.tsv", "MNLI-mm.tsv")),
        "qnli": (("accuracy",), "accuracy", True, ("entailment", "not_entailment"), ("QNLI.tsv",)),
        "rte": (("accuracy",), "accuracy", True, ("entailment", "not_entailment"), ("RTE.tsv",)),
        "wnli": (("accuracy",), "accuracy", True, ("0", "1"), ("WNLI.tsv",)),
    }
    for name, (metrics, main, pair, labels, files) in expected.items():
        t = TASKS[name]
        assert (t.metrics, t.main_metric, t.is_pair, t.tsv_labels, t.submission_files) == (
            metrics, main, pair, labels, files), name
        assert t.num_labels == (1 if name == "stsb" else len(labels))
    mnli = TASKS["mnli"]
    assert mnli.validation_splits == ("validation_matched", "validation_mismatched")
    assert mnli.test_splits == ("test_matched", "test_mismatched")
    assert mnli.tsv_file("validation_mismatched") == "dev_mismatched.tsv"
    assert TASKS["rte"].validation_splits == ("validation",) and TASKS["rte"].tsv_file("test") == "test.tsv"
    assert TASKS["stsb"].is_regression and TASKS["stsb"].num_labels == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        mnli.main_metric = "f1"  # type: ignore[misc]
    assert get_task("SST-2") is TASKS["sst2"] and get_task("STS-B") is TASKS["stsb"]
    assert get_task("CoLA") is TASKS["cola"]


# ------------------------------------------------------------------------------------------- GLUE TSVs


def test_cola_headerless_dev_and_headed_test(glue_dir: Path) -> None:
    dev = load_examples(f"glue:cola:{glue_dir / 'CoLA'}", "validation")
    assert dev.text_a == ("The sailors rode the breeze clear of the rocks.",
                          "One more pseudo generalization and I'm giving up.", 'He said "hi.')
    assert dev.text_b is None
    assert dev.labels.dtype == np.int32 and dev.labels.tolist() == [1, 0, 1]
    assert dev.index.tolist() == [0, 1, 2] and dev.labelled
    test = load_examples(f"glue:cola:{glue_dir}", "test")  # the glue_data folder above CoLA/ works too
    assert test.text_a == ("Bill whistled past the house.", "The car honked its way down the road.")
    assert test.labels.tolist() == [-1, -1] and test.index.tolist() == [0, 1] and not test.labelled


def test_every_task_reads(glue_dir: Path) -> None:
    sst2 = load_examples(f"glue:sst2:{glue_dir}", "validation")
    assert sst2.text_a == ("it 's a charming and often affecting journey . ", "unflinchingly bleak and desperate ")
    assert sst2.labels.tolist() == [1, 0] and sst2.index.tolist() == [0, 1]

    mrpc = load_examples(f"glue:mrpc:{glue_dir}", "train")  # the header starts with a byte-order mark
    assert mrpc.text_a == ('Amrozi called him " the witness " .', "Yucaipa owned Dominick 's .")
    assert mrpc.text_b == ('Referring to him as " the witness " , Amrozi spoke .',
                           "Yucaipa bought Dominick 's in 1995 .")
    assert mrpc.labels.tolist() == [1, 0]
    mrpc_test = load_examples(f"glue:mrpc:{glue_dir}", "test")
    assert mrpc_test.text_b == ("The chief of PCCW is leaving .",) and mrpc_test.labels.tolist() == [-1]

    stsb = load_examples(f"glue:stsb:{glue_dir}", "validation")
    assert stsb.labels.dtype == np.float32 and stsb.labels.tolist() == [5.0, 4.75]
    assert stsb.text_b == ("A man wearing a hard hat is dancing.", "A child is riding a horse.")
    stsb_test = load_examples(f"glue:stsb:{glue_dir}", "test")
    assert math.isnan(stsb_test.labels[0]) and stsb_test.index.tolist() == [0]

    qqp = load_examples(f"glue:qqp:{glue_dir}", "validation")
    assert qqp.index.tolist() == [201359, 226] and qqp.labels.tolist() == [0, 1]
    assert qqp.text_a[1] == "How do I learn Python?" and qqp.text_b[1] == "How can I learn Python?"
    qqp_test = load_examples(f"glue:qqp:{glue_dir}", "test")
    assert qqp_test.index.tolist() == [7] and qqp_test.text_b == ('Is "it" ok?',)

    qnli = load_examples(f"glue:qnli:{glue_dir}", "validation")
    assert qnli.labels.tolist() == [0, 1]  # entailment, not_entailment
    assert qnli.text_a[0] == "What came into force after the new constitution was herald?"
    rte = load_examples(f"glue:rte:{glue_dir}", "validation")
    assert rte.labels.tolist() == [1, 0] and rte.text_b == ("Christopher Reeve had an accident.",
                                                            "Bacteria is winning.")
    wnli = load_examples(f"glue:wnli:{glue_dir}", "validation")
    assert wnli.labels.tolist() == [0, 1]


def test_mnli_both_dev_files_and_test(glue_dir: Path) -> None:
    src = parse_source(f"glue:MNLI:{glue_dir / 'MNLI'}")
    assert src.kind == "tsv" and src.path == glue_dir / "MNLI"
    m = load_examples(src, "validation_matched")
    assert m.text_a == tuple(a for a, _, _ in MNLI_MATCHED) and m.text_b == tuple(b for _, b, _ in MNLI_MATCHED)
    assert m.labels.tolist() == [2, 0, 1]  # neutral, contradiction, entailment in (contradiction, entailment, neutral)
    mm = load_examples(src, "validation_mismatched")
    assert mm.labels.tolist() == [0, 1] and mm.text_a[1] == "yeah well that's true"
    t = load_examples(src, "test_matched")
    assert t.index.tolist() == [10, 11] and t.labels.tolist() == [-1, -1]
    assert t.text_b == ("Hierbas is a name.", "It was low.")


# ----------------------------------------------------------------------------------------- bad input


def test_source_errors(glue_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError) as e:
        parse_source(f"glue:mnlii:{glue_dir}")
    assert 'did you mean "mnli"' in _one_line_error(e)
    with pytest.raises(UserError) as e:
        parse_source("glue:cola:/no/such/folder")
    assert "/no/such/folder does not exist" in _one_line_error(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as e:
        parse_source(f"glue:rte:{tmp_path / 'empty'}")
    assert "holds neither GLUE's RTE files" in _one_line_error(e)
    for bad in ("glue", "glue:", "tsv:cola:/x"):
        with pytest.raises(UserError) as e:
            parse_source(bad)
        assert "glue:TASK:DIR" in _one_line_error(e)
    assert parse_source("glue:sst-2").kind == "hub" and parse_source("glue:sst-2").path is None
    with pytest.raises(UserError) as e:  # MNLI has no plain "validation"
        load_examples(f"glue:mnli:{glue_dir}", "validation")
    assert 'did you mean "validation_matched"' in _one_line_error(e)
    with pytest.raises(UserError) as e:  # the fixture has no MNLI train.tsv
        load_examples(f"glue:mnli:{glue_dir}", "train")
    assert "train.tsv does not exist" in _one_line_error(e)


def test_row_errors_name_file_and_line(tmp_path: Path) -> None:
    header = ["index", "sentence1", "sentence2", "label"]
    _write(tmp_path / "RTE/dev.tsv", [header, ["0", "a", "b", "entailment"], ["1", "c", "d", "entailed"]])
    with pytest.raises(UserError) as e:
        load_examples(f"glue:rte:{tmp_path}", "validation")
    msg = _one_line_error(e)
    assert f"{tmp_path / 'RTE/dev.tsv'}, line 3" in msg and "unknown rte label 'entailed'" in msg

    _write(tmp_path / "QNLI/dev.tsv", [["index", "question", "sentence", "label"],
                                       ["0", "q?", "s.", "entailment"],
                                       ["1", "q2?", "not_entailment"],
                                       ["2", "q3?", "s3.", "not_entailment"]])
    with pytest.raises(UserError) as e:
        load_examples(f"glue:qnli:{tmp_path}", "validation")
    msg = _one_line_error(e)
    assert f"{tmp_path / 'QNLI/dev.tsv'}, line 3" in msg and "expected 4 tab-separated columns, found 3" in msg
    kept = load_examples(f"glue:qnli:{tmp_path}", "validation", skip_bad_rows=True)
    assert kept.index.tolist() == [0, 2] and kept.labels.tolist() == [0, 1]

    _write(tmp_path / "SST-2/dev.tsv", [["sentence"], ["no label column"]])
    with pytest.raises(UserError) as e:
        read_tsv("sst2", tmp_path / "SST-2/dev.tsv", "validation")
    assert "no label column 'label'" in _one_line_error(e)


# ---------------------------------------------------------------------------------------- Hugging Face


def test_hugging_face_labels_map_to_the_tsv_order(glue_dir: Path, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    # Hugging Face's MNLI: premise/hypothesis, ClassLabel(entailment=0, neutral=1, contradiction=2), idx.
    mnli_features = datasets.Features({
        "premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
        "label": datasets.ClassLabel(names=["entailment", "neutral", "contradiction"]),
        "idx": datasets.Value("int32")})
    hf_id = {"entailment": 0, "neutral": 1, "contradiction": 2}
    datasets.DatasetDict({
        "validation_matched": datasets.Dataset.from_dict(
            {"premise": [a for a, _, _ in MNLI_MATCHED], "hypothesis": [b for _, b, _ in MNLI_MATCHED],
             "label": [hf_id[g] for _, _, g in MNLI_MATCHED], "idx": [0, 1, 2]}, features=mnli_features),
        "test_matched": datasets.Dataset.from_dict(
            {"premise": ["Hierbas, ans seco."], "hypothesis": ["Hierbas is a name."], "label": [-1], "idx": [10]},
            features=mnli_features),
    }).save_to_disk(str(tmp_path / "hf_mnli"))
    src = parse_source(f"glue:mnli:{tmp_path / 'hf_mnli'}")
    assert src.kind == "hf_disk"
    hf = load_examples(src, "validation_matched")
    tsv = load_examples(f"glue:mnli:{glue_dir}", "validation_matched")
    assert hf.labels.tolist() == tsv.labels.tolist() == [2, 0, 1]
    tok = ByteTokenizer()
    a, b = encode(hf, tok, 96), encode(tsv, tok, 96)
    for k in ("inputs", "positions", "labels", "index"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    test = load_examples(src, "test_matched")
    assert test.labels.tolist() == [-1] and test.index.tolist() == [10]

    # Plain integer labels (no ClassLabel): Hugging Face's id order is assumed. RTE: entailment=0.
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict(
        {"sentence1": ["Dana Reeve, the widow of the actor, has died.", "Yet, we now are discovering it."],
         "sentence2": ["Christopher Reeve had an accident.", "Bacteria is winning."], "label": [1, 0],
         "idx": [0, 1]})}).save_to_disk(str(tmp_path / "hf_rte"))
    rte_hf = load_examples(f"glue:rte:{tmp_path / 'hf_rte'}", "validation")
    rte_tsv = load_examples(f"glue:rte:{glue_dir}", "validation")
    assert rte_hf.labels.tolist() == rte_tsv.labels.tolist() == [1, 0]  # not_entailment, entailment

    # STS-B: float scores; Hugging Face marks unlabelled test rows -1.
    datasets.DatasetDict({
        "validation": datasets.Dataset.from_dict({"sentence1": ["x", "y"], "sentence2": ["u", "v"],
                                                  "label": [5.0, 4.75], "idx": [0, 1]}),
        "test": datasets.Dataset.from_dict({"sentence1": ["x"], "sentence2": ["u"], "label": [-1.0], "idx": [0]}),
    }).save_to_disk(str(tmp_path / "hf_stsb"))
    assert load_examples(f"glue:stsb:{tmp_path / 'hf_stsb'}", "validation").labels.tolist() == [5.0, 4.75]
    assert math.isnan(load_examples(f"glue:stsb:{tmp_path / 'hf_stsb'}", "test").labels[0])
    with pytest.raises(UserError) as e:
        load_examples(f"glue:stsb:{tmp_path / 'hf_stsb'}", "train")
    assert "has no split 'train' (it has validation, test)" in _one_line_error(e)
    with pytest.raises(UserError) as e:  # QNLI's columns are question/sentence, not sentence1/sentence2
        load_examples(f"glue:qnli:{tmp_path / 'hf_stsb'}", "validation")
    assert "has no column 'question'" in _one_line_error(e)


# -------------------------------------------------------------------------------------------- encoding


def _examples(task: str, a: list[str], b: list[str] | None, labels: list[float]) -> GlueExamples:
    t = TASKS[task]
    dtype = np.float32 if t.is_regression else np.int32
    return GlueExamples(t, "validation", tuple(a), None if b is None else tuple(b), np.array(labels, dtype=dtype),
                        np.arange(len(a), dtype=np.int32), "test")


def test_encode_pairs_by_hand() -> None:
    ex = _examples("rte", ["ab", "abcd", "abc", "\u00e9", "a"], ["xyz", "xy", "xyz", "", "wxyz"], [0, 1, 0, 1, -1])
    # a=97 b=98 c=99 d=100, w=119 x=120 y=121 z=122, é = bytes 195 169
    expected = {
        10: [[E, 97, 98, E, 120, 121, 122, E, E, E],  # fits: [eot] ab [eot] xyz [eot] + 2 pads; final eot at 7
             [E, 97, 98, 99, 100, E, 120, 121, E, E],
             [E, 97, 98, 99, E, 120, 121, 122, E, E],
             [E, 195, 169, E, E, E, E, E, E, E],  # empty second segment: [eot] é [eot] [eot]
             [E, 97, E, 119, 120, 121, 122, E, E, E]],
        7: [[E, 97, 98, E, 120, 121, E],  # budget 4: (2,3) -> b longer, drop z -> (2,2)
            [E, 97, 98, E, 120, 121, E],  # (4,2): a longer, drop d, then c -> (2,2)
            [E, 97, 98, E, 120, 121, E],  # (3,3): tie drops from b -> (3,2), a -> (2,2)
            [E, 195, 169, E, E, E, E],
            [E, 97, E, 119, 120, 121, E]],  # (1,4) -> b cut to 3
        6: [[E, 97, 98, E, 120, E],  # budget 3: (2,3) -> (2,2) -> tie drops b -> (2,1)
            [E, 97, 98, E, 120, E],  # (4,2) -> (3,2) -> (2,2) -> (2,1)
            [E, 97, 98, E, 120, E],  # (3,3) -> (3,2) -> (2,2) -> (2,1)
            [E, 195, 169, E, E, E],
            [E, 97, E, 119, 120, E]],  # (1,4) -> (1,2)
    }
    positions = {10: [7, 8, 8, 4, 7], 7: [6, 6, 6, 4, 6], 6: [5, 5, 5, 4, 5]}
    for seq_len, rows in expected.items():
        out = encode(ex, ByteTokenizer(), seq_len)
        assert out["inputs"].dtype == np.int32 and out["inputs"].shape == (5, seq_len)
        assert out["inputs"].tolist() == rows, seq_len
        assert out["positions"].dtype == np.int32 and out["positions"].tolist() == positions[seq_len], seq_len
        assert out["labels"].dtype == np.int32 and out["labels"].tolist() == [0, 1, 0, 1, -1]
        assert out["index"].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(UserError) as e:
        encode(ex, ByteTokenizer(), 2)
    assert "seq_len >= 3" in _one_line_error(e)


def test_encode_single_and_regression_by_hand() -> None:
    out = encode(_examples("sst2", ["hello", "hi"], None, [1, 0]), ByteTokenizer(), 4)
    # h=104 e=101 i=105: "hello" keeps "he" (budget 2); "hi" fits exactly.
    assert out["inputs"].tolist() == [[E, 104, 101, E], [E, 104, 105, E]]
    assert out["positions"].tolist() == [3, 3]
    out = encode(_examples("stsb", ["a"], ["b"], [float("nan")]), ByteTokenizer(), 6)
    assert out["inputs"].tolist() == [[E, 97, E, 98, E, E]] and out["positions"].tolist() == [4]
    assert out["labels"].dtype == np.float32 and math.isnan(out["labels"][0])


def test_truncation_matches_one_token_at_a_time() -> None:
    def reference(la: int, lb: int, budget: int) -> tuple[int, int]:
        while la + lb > budget:  # the documented rule, literally
            if la > lb:
                la -= 1
            else:
                lb -= 1
        return la, lb

    for la in range(9):
        for lb in range(9):
            for budget in range(12):
                assert truncated_lengths(la, lb, budget) == reference(la, lb, budget), (la, lb, budget)


# --------------------------------------------------------------------------------------------- metrics


def test_metrics_by_hand() -> None:
    pred, gold = [1, 0, 1, 1, 0], [1, 1, 0, 1, 0]
    # agree at 0, 3, 4 -> 3/5; tp = 2 (0, 3), fp = 1 (2), fn = 1 (1), tn = 1 (4)
    assert accuracy(pred, gold) == pytest.approx(3 / 5)
    assert f1(pred, gold) == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))  # = 2/3
    # (tp tn - fp fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn)) = (2 - 1) / sqrt(3 * 3 * 2 * 2) = 1/6
    assert matthews_corrcoef(pred, gold) == pytest.approx(1 / 6)
    assert matthews_corrcoef([1, 0, 1], [1, 0, 1]) == pytest.approx(1.0)
    assert matthews_corrcoef([0, 1, 0], [1, 0, 1]) == pytest.approx(-1.0)
    # degenerate: one class on a side -> 0, not NaN
    assert matthews_corrcoef([1, 1, 1], [1, 0, 1]) == 0.0
    assert matthews_corrcoef([1, 0, 1], [0, 0, 0]) == 0.0
    assert f1([0, 0, 0], [1, 0, 1]) == 0.0  # no positive predicted
    assert f1([0, 0], [0, 0]) == 0.0  # no positives anywhere
    assert f1([1, 1, 0], [0, 0, 0]) == 0.0  # nothing to find
    x, y = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 5.0, 9.0]
    # dx = -1.5 -.5 .5 1.5, dy = -3 -1 0 4: sum dx dy = 4.5 + .5 + 0 + 6 = 11, sum dx^2 = 5, sum dy^2 = 26
    assert pearson(x, y) == pytest.approx(11 / math.sqrt(5 * 26))
    assert spearman(x, y) == pytest.approx(1.0)  # monotone
    # ties: ranks of [1, 2, 2, 3] are [1, 2.5, 2.5, 4]; of [1, 3, 2, 4] are [1, 3, 2, 4]
    # dx = -1.5 0 0 1.5, dy = -1.5 .5 -.5 1.5: sum dx dy = 4.5, sum dx^2 = 4.5, sum dy^2 = 5
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert pearson([3.0, 3.0, 3.0], [1.0, 2.0, 3.0]) == 0.0  # constant: undefined, reported as 0


def test_correlations_agree_with_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, size=40).astype(np.float64)  # many ties
    y = x + rng.normal(size=40)
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0])
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0])
    assert spearman(x, np.round(y)) == pytest.approx(stats.spearmanr(x, np.round(y))[0])


def test_score() -> None:
    logits = np.array([[0.2, 0.8], [0.9, 0.1], [0.3, 0.7], [0.1, 0.9], [0.6, 0.4]])  # argmax 1 0 1 1 0
    out = score("mrpc", logits, np.array([1, 1, 0, 1, 0], dtype=np.int32))
    assert out == pytest.approx({"f1": 2 / 3, "accuracy": 3 / 5, "main": 2 / 3})
    out = score("cola", [1, 0, 1, 1, 0], [1, 1, 0, 1, 0])
    assert out == pytest.approx({"matthews_corrcoef": 1 / 6, "main": 1 / 6})
    out = score("stsb", np.array([[1.0], [2.0], [3.0], [4.0]]), np.array([2.0, 4.0, 5.0, 9.0], dtype=np.float32))
    assert out == pytest.approx({"pearson": 11 / math.sqrt(130), "spearman": 1.0, "main": 1.0})
    with pytest.raises(UserError) as e:
        score("rte", [0, 1], [0, -1])
    assert "unlabelled" in _one_line_error(e)
    with pytest.raises(UserError) as e:
        score("mnli", np.zeros((2, 2)), [0, 1])
    assert "[N, 3]" in _one_line_error(e)


# ------------------------------------------------------------------------------------------ submission


def test_write_submission(tmp_path: Path) -> None:
    out = tmp_path / "sub"
    p = write_submission("mnli", "test_mismatched", [2, 0, 1], [0, 2, 1], out)
    assert p == out / "MNLI-mm.tsv"
    # index 0 -> id 2 (neutral), 1 -> 1 (entailment), 2 -> 0 (contradiction)
    assert _read(p) == "index\tprediction\n0\tneutral\n1\tentailment\n2\tcontradiction\n"
    p = write_submission("mnli", "test_matched", [0], np.array([[0.1, 0.2, 0.7]]), out)
    assert p.name == "MNLI-m.tsv" and _read(p) == "index\tprediction\n0\tneutral\n"
    p = write_submission("cola", "test", [1, 0], [0, 1], out)
    assert _read(p) == "index\tprediction\n0\t1\n1\t0\n" and p.name == "CoLA.tsv"
    p = write_submission("wnli", "test", [0, 1], [1, 0], out)
    assert _read(p) == "index\tprediction\n0\t1\n1\t0\n"
    p = write_submission("qnli", "test", [0, 1], [1, 0], out)
    assert _read(p) == "index\tprediction\n0\tnot_entailment\n1\tentailment\n"
    p = write_submission("STS-B", "test", [0, 1, 2], np.array([-0.3, 2.25, 5.7], dtype=np.float32), out)
    assert p.name == "STS-B.tsv"
    assert _read(p) == "index\tprediction\n0\t0.000000\n1\t2.250000\n2\t5.000000\n"  # clipped to [0, 5]
    p = write_submission("cola", "test", [0, 1], [1, 1], out)  # overwrites
    assert _read(p) == "index\tprediction\n0\t1\n1\t1\n"
    assert sorted(os.listdir(out)) == ["CoLA.tsv", "MNLI-m.tsv", "MNLI-mm.tsv", "QNLI.tsv", "STS-B.tsv",
                                       "WNLI.tsv"]  # no temporary files left
    with pytest.raises(UserError) as e:
        write_submission("rte", "validation", [0], [0], out)
    assert "test split" in _one_line_error(e)
    with pytest.raises(UserError) as e:
        write_submission("rte", "test", [0, 0], [0, 1], out)
    assert "repeat" in _one_line_error(e)
