"""experiments.paired: cells of two sweeps' results.csv paired by seed, against a hand computation."""

from __future__ import annotations

import csv
import json

import pytest

from coupled_qk_jax.errors import UserError
from experiments import paired

T_975_DF2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom (printed tables: 4.303)


def _table(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["run", "variant", "val_ppl_seeds"])
        w.writeheader()
        w.writerows(rows)
    return str(path)


def test_pairs_seed_by_seed_with_a_t_interval(tmp_path):
    a = _table(tmp_path / "a.csv", [{"run": "n1", "variant": "coupled_euler", "val_ppl_seeds": "100.0 50.0 20.0"}])
    b = _table(tmp_path / "b.csv", [{"run": "n7", "variant": "coupled_euler", "val_ppl_seeds": "101.0 51.5 21.0"}])
    text = paired.paired_table(f"{a}:n1", f"{b}:n7")
    # per seed +1%, +3%, +5%: mean 3, sample std 2, half width t * 2 / sqrt(3)
    half = T_975_DF2 * 2.0 / 3 ** 0.5
    assert "| 0 | 100.000 | 101.000 | +1.00 |" in text and "| 2 | 20.000 | 21.000 | +5.00 |" in text
    assert f"mean +3.00%, sample std 2.00%, 95% paired-t interval [{3 - half:+.2f}, {3 + half:+.2f}]" in text


def test_refuses_what_cannot_be_paired(tmp_path, capsys):
    a = _table(tmp_path / "a.csv", [{"run": "x", "variant": "standard", "val_ppl_seeds": "10.0 11.0"}])
    b = _table(tmp_path / "b.csv", [{"run": "y", "variant": "standard", "val_ppl_seeds": "10.0 11.0 12.0"}])
    with pytest.raises(UserError, match="2 seeds .* 3"):
        paired.paired_table(f"{a}:x", f"{b}:y")
    with pytest.raises(UserError, match="no run 'z'; its runs: x"):
        paired.paired_table(f"{a}:z", f"{b}:y")
    with pytest.raises(SystemExit) as e:
        paired.main([f"{a}", f"{b}:y"])  # no ':RUN'
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: expected RESULTS_CSV:RUN")


def test_pairs_a_diagnostic_from_the_run_jsons(tmp_path, capsys):
    # Per-seed effective ranks 40, 50, 20 against 40.4, 51.5, 21: +1%, +3%, +5% as above.
    rows = [{"run": "standard", "variant": "standard", "val_ppl_seeds": "1.0 1.0 1.0"},
            {"run": "coupled_euler", "variant": "coupled_euler", "val_ppl_seeds": "1.0 1.0 1.0"}]
    table = _table(tmp_path / "results.csv", rows)
    (tmp_path / "runs").mkdir()
    for run, ranks in (("standard", (40.0, 50.0, 20.0)), ("coupled_euler", (40.4, 51.5, 21.0))):
        (tmp_path / "runs" / f"{run}.json").write_text(json.dumps(
            {"diagnostics": [{"model_mean": {"effective_rank": r, "entropy": 1.0}} for r in ranks]}))
    text = paired.paired_table(f"{table}:standard", f"{table}:coupled_euler", metric="effective_rank")
    half = T_975_DF2 * 2.0 / 3 ** 0.5
    assert "| seed | A effective_rank | B effective_rank | B vs A % |" in text
    assert "| 1 | 50.000 | 51.500 | +3.00 |" in text
    assert f"mean +3.00%, sample std 2.00%, 95% paired-t interval [{3 - half:+.2f}, {3 + half:+.2f}]" in text
    with pytest.raises(UserError, match="no per-seed diagnostic 'sink_mass'; its diagnostics: effective_rank"):
        paired.paired_table(f"{table}:standard", f"{table}:coupled_euler", metric="sink_mass")
    (tmp_path / "runs" / "standard.json").unlink()  # a table whose run JSONs were not committed
    with pytest.raises(SystemExit) as e:
        paired.main(["--metric", "effective_rank", f"{table}:standard", f"{table}:coupled_euler"])
    assert e.value.code == 2 and "no per-seed diagnostics of 'standard' were committed" in capsys.readouterr().err


def test_first_n_seeds_pair_a_shorter_run(tmp_path):
    a = _table(tmp_path / "a.csv",
               [{"run": "x", "variant": "coupled_euler", "val_ppl_seeds": "100.0 50.0 20.0 9.0 7.0"}])
    b = _table(tmp_path / "b.csv", [{"run": "y", "variant": "coupled_leapfrog", "val_ppl_seeds": "101.0 51.5 21.0"}])
    text = paired.paired_table(f"{a}:x", f"{b}:y", first=3)
    half = T_975_DF2 * 2.0 / 3 ** 0.5
    assert f"mean +3.00%, sample std 2.00%, 95% paired-t interval [{3 - half:+.2f}, {3 + half:+.2f}] (3 seeds)" in text
    with pytest.raises(UserError, match="--first 4: .* has 5 seeds and .* has 3"):
        paired.paired_table(f"{a}:x", f"{b}:y", first=4)
