"""Where rows come from: several datasets at once (OpenRLHF's comma-separated --prompt_data,
concatenated or mixed by --prompt_data_probs, the first --max_samples of each) and folders that
``datasets``' ``save_to_disk`` wrote."""
from __future__ import annotations

import json
import re

import pytest

from rlhf_plugins.data.sources import read_rows
from rlhf_plugins.errors import DataError


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def two(tmp_path):
    a = [{"prompt": f"a{i}", "label": str(i)} for i in range(3)]
    b = [{"prompt": f"b{i}", "label": str(i)} for i in range(6)]
    return a, b, f"{jsonl(tmp_path / 'a.jsonl', a)},{jsonl(tmp_path / 'b.jsonl', b)}"


def test_several_datasets_are_concatenated_in_order_and_max_samples_cuts_each(two):
    a, b, path = two
    assert read_rows(path) == a + b
    assert read_rows(path, limit=2) == a[:2] + b[:2]


def test_probs_draw_each_row_from_a_dataset_until_every_dataset_is_used_up(two):
    a, b, path = two
    mixed = read_rows(path, probs=[0.3, 0.7], seed=5)
    from_a = [r for r in mixed if r["prompt"].startswith("a")]
    from_b = [r for r in mixed if r["prompt"].startswith("b")]
    # each dataset is read in its order, cycling when it runs out before the other is used up
    assert from_a == (a * len(mixed))[:len(from_a)] and from_b == (b * len(mixed))[:len(from_b)]
    assert len(from_a) >= len(a) and len(from_b) >= len(b)  # every row of both at least once
    assert len(from_a) == len(a) or len(from_b) == len(b)  # and it stops when the last one runs out
    assert mixed == read_rows(path, probs=[3, 7], seed=5)  # probabilities are normalized
    assert mixed == read_rows(path, probs=[0.3, 0.7], seed=5)  # seeded
    draws = [read_rows(path, probs=[0.5, 0.5], seed=s) for s in range(6)]
    assert len({json.dumps(d) for d in draws}) > 1  # the seed decides the order


def test_probs_follow_their_weights_over_many_rows(tmp_path):
    big = [{"prompt": f"x{i}"} for i in range(2000)]
    small = [{"prompt": f"y{i}"} for i in range(2000)]
    path = f"{jsonl(tmp_path / 'x.jsonl', big)},{jsonl(tmp_path / 'y.jsonl', small)}"
    mixed = read_rows(path, probs=[0.8, 0.2], seed=0)
    head = mixed[:1000]  # before either runs out: rows come from x with probability 0.8
    share = sum(r["prompt"].startswith("x") for r in head) / len(head)
    assert abs(share - 0.8) < 0.05, share


def test_datasets_of_different_columns_are_one_line(tmp_path):
    path = f"{jsonl(tmp_path / 'a.jsonl', [{'prompt': 'p'}])},{jsonl(tmp_path / 'b.jsonl', [{'question': 'q'}])}"
    with pytest.raises(DataError, match="have different columns \\(prompt \\| question\\); give every dataset"):
        read_rows(path)


def test_a_save_to_disk_folder_reads_as_its_rows_and_a_dataset_dict_as_its_train_split(tmp_path):
    import datasets

    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "label": str(i + 1)} for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    assert read_rows(tmp_path / "one") == rows
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                                   "test": datasets.Dataset.from_list(rows[3:])})
    splits.save_to_disk(str(tmp_path / "dict"))
    assert read_rows(tmp_path / "dict") == rows[:3]
    assert read_rows(tmp_path / "dict" / "test") == rows[3:]
    datasets.DatasetDict({"a": splits["train"], "b": splits["test"]}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(DataError, match=f"holds the splits a, b and no 'train'; give one: {tmp_path}/ab/a"):
        read_rows(tmp_path / "ab")


def test_a_run_on_two_mixed_datasets_trains_on_the_first_rows_of_each(rlhf, tmp_path):
    from tests.helpers import rollout_spy, short_run

    a = jsonl(tmp_path / "a.jsonl", [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(5)])
    b = jsonl(tmp_path / "b.jsonl", [{"prompt": f"{i}+2=", "label": str(i + 2)} for i in range(5)])
    plugin, seen = rollout_spy(tmp_path)
    code, _, err = rlhf("train", "--plugin", str(plugin), "--data.path", f"{a},{b}", "--data.probs", "0.5,0.5",
                        "--data.max_samples", "2", "--reward.functions", "exact_match", *short_run())
    assert code == 0, err
    prompts = {p for step_prompts, _ in seen() for p in step_prompts}
    assert prompts == {"0+1=", "1+1=", "0+2=", "1+2="}  # both datasets, their first two rows only


def test_a_damaged_save_to_disk_folder_is_one_line(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"prompt": "1+1="}]).save_to_disk(str(tmp_path / "d"))
    for arrow in (tmp_path / "d").glob("*.arrow"):
        arrow.write_bytes(b"not arrow")
    with pytest.raises(DataError, match=f"^dataset folder '{tmp_path}/d' cannot be read: "):
        read_rows(tmp_path / "d")


def test_csv_and_arrow_files_and_folders_read_as_their_rows(tmp_path):
    """The other file types OpenRLHF's --prompt_data takes through ``datasets``: CSV (numbers typed as
    numbers, as ``datasets`` reads them) and Arrow, in its stream and its file format, alone or in a folder."""
    import pyarrow as pa

    rows = [{"prompt": f"{i}+1=", "label": i + 1} for i in range(4)]
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "a.csv").write_text("prompt,label\n" + "".join(f"{r['prompt']},{r['label']}\n" for r in rows[:2]))
    (tmp_path / "csv" / "b.csv").write_text("prompt,label\n" + "".join(f"{r['prompt']},{r['label']}\n" for r in rows[2:]))
    assert read_rows(tmp_path / "csv" / "a.csv") == rows[:2]
    assert read_rows(tmp_path / "csv") == rows
    table = pa.Table.from_pylist(rows)
    for name, writer in (("stream.arrow", pa.ipc.new_stream), ("file.arrow", pa.ipc.new_file)):
        with writer(str(tmp_path / name), table.schema) as out:
            out.write_table(table)
        assert read_rows(tmp_path / name) == rows, name
    assert read_rows(f"{tmp_path / 'csv' / 'a.csv'},{tmp_path / 'stream.arrow'}") == rows[:2] + rows


def test_a_run_on_a_csv_file_trains_on_its_prompts_and_scores_its_numeric_labels(rlhf, tmp_path):
    """A CSV's label column arrives as numbers and exact_match scores the completions against them."""
    from tests.helpers import samples_of, short_run, the_run

    (tmp_path / "sums.csv").write_text("question,answer\n" + "".join(f"{i}+{j}=,{i + j}\n" for i in range(4)
                                                                     for j in range(3)))
    code, _, err = rlhf("train", "--data.path", str(tmp_path / "sums.csv"), "--data.prompt_key", "question",
                        "--data.label_key", "answer", "--reward.functions", "exact_match",
                        "--train.log_samples_every", "1", *short_run("--train.steps", "4"))
    assert code == 0, err
    samples = samples_of(the_run())
    assert {s["prompt"] for s in samples} <= {f"{i}+{j}=" for i in range(4) for j in range(3)}
    assert all(isinstance(s["columns"]["label"], int) for s in samples)
    a, b = (int(x) for x in samples[0]["prompt"].rstrip("=").split("+"))
    assert samples[0]["columns"]["label"] == a + b
    for s in samples:  # the answer's leading number against the label's value
        found = re.match(r"\s*(\d+)", s["completion"])
        assert s["reward"] == float(found is not None and int(found.group(1)) == s["columns"]["label"]), s
    assert any(s["reward"] == 1.0 for s in samples)  # some answers right, scored against the numbers
