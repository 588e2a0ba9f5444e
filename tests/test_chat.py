"""Post-training data (maxpar.io.data.chat, maxpar.io.data.conversations): chat templates rendered and masked as
transformers does, conversation and pair records tokenized, packed whole into rows, resumed exactly; bad records
refused naming them. Pure unit tests: no compiled step."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from maxpar.core.config import ConfigError
from maxpar.io.data.chat import load_chat_template
from maxpar.io.data.conversations import Formatter, fitted, record_batches
from maxpar.io.data.records import JsonlRecords, Record
from maxpar.io.data.tokenizer import load_tokenizer
from maxpar.tools.post_training_data import CHAT_TEMPLATE, build_tokenizer, conversations, pairs, write_jsonl

CONVERSATIONS = [
    [{"role": "user", "content": "What does json.dumps() do?"},
     {"role": "assistant", "content": "Serialize obj to a JSON formatted str."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello: ünïcode — fine."}, {"role": "user", "content": "and?"},
     {"role": "assistant", "content": "Two turns, both trained."}],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def fmt(tokenizer_dir) -> Formatter:
    path = str(tokenizer_dir / "tokenizer.json")
    return Formatter(load_tokenizer(path), load_chat_template(path))


def record(data, where="test record 1") -> Record:
    return Record(data, where)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one_turn", "system_two_turns"])
def test_ids_and_assistant_mask_equal_transformers(messages, fmt, tokenizer_dir):
    theirs = AutoTokenizer.from_pretrained(tokenizer_dir).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    (ours,) = fmt.conversation(record({"messages": messages}))
    assert ours.ids.tolist() == theirs["input_ids"]
    assert ours.mask.tolist() == theirs["assistant_masks"]
    assert 0 < ours.mask.sum() < len(ours.mask)


def test_template_without_generation_blocks_masks_the_same_turns(fmt):
    """Rendering the turns' prefixes and diffing finds what the generation blocks mark (the same template with
    blocks that mark nothing, so that it renders the same text)."""
    source = CHAT_TEMPLATE.replace("{% generation %}", "{% if true %}").replace("{% endgeneration %}", "{% endif %}")
    plain = dataclasses.replace(fmt, template=dataclasses.replace(fmt.template, source=source))
    assert not plain.template.marks_generation
    for messages in CONVERSATIONS:
        (marked,), (diffed,) = fmt.conversation(record({"messages": messages})), plain.conversation(
            record({"messages": messages}))
        np.testing.assert_array_equal(marked.ids, diffed.ids)
        np.testing.assert_array_equal(marked.mask, diffed.mask)


def test_whole_sequence_loss_masks_every_token(fmt):
    (tokens,) = dataclasses.replace(fmt, completion_only=False).conversation(record({"messages": CONVERSATIONS[1]}))
    assert tokens.mask.all()


def test_template_that_rewrites_earlier_turns_is_refused(fmt):
    """A template rendering a turn differently once a later one follows cannot be diffed: refused, naming the turn."""
    source = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last %}.{% endif %}\n"
              "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    rewriting = dataclasses.replace(fmt, template=dataclasses.replace(fmt.template, source=source))
    with pytest.raises(ConfigError, match=r"test record 1: .*assistant turn 1 .*\{% generation %\}"):
        rewriting.conversation(record({"messages": CONVERSATIONS[0]}))


def test_template_read_from_tokenizer_config_or_file(tmp_path, tokenizer_dir):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ bos_token }}x"}))
    assert load_chat_template(str(tmp_path / "tokenizer.json")).render([]).text == "<|endoftext|>x"
    (tmp_path / "t.jinja").write_text("{{ eos_token }}y")
    assert load_chat_template(str(tmp_path / "tokenizer.json"), str(tmp_path / "t.jinja")).render([]).text == \
        "<|im_end|>y"


def test_missing_template_is_one_line_naming_the_key(tmp_path, tokenizer_dir):
    (tmp_path / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text())
    with pytest.raises(ConfigError, match="has no chat_template .*set chat_template_path") as error:
        load_chat_template(str(tmp_path / "tokenizer.json"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("data, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "test record 1: the conversation has no assistant turn"),
    ({"text": "hi"}, "test record 1: no 'messages'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"test record 1: messages\[0\] is not a message"),
])
def test_bad_conversations_name_the_record(data, message, fmt):
    with pytest.raises(ConfigError, match=message):
        fmt.conversation(record(data))


@pytest.mark.parametrize("data, message", [
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "test record 1: the chosen response is empty"),
    ({"prompt": "q", "chosen": "a", "rejected": []}, "test record 1: the rejected response is empty"),
    ({"chosen": "a", "rejected": "b"}, "test record 1: no 'prompt'"),
])
def test_bad_pairs_name_the_record(data, message, fmt):
    with pytest.raises(ConfigError, match=message):
        fmt.pair(record(data))


def test_pair_masks_the_responses_after_the_shared_prompt(fmt):
    """Text pairs end in EOS; conversational ones are the template's; the mask starts where they leave the prompt."""
    for data in ({"prompt": "What does x do?", "chosen": " It adds.", "rejected": " It sorts."},
                 {"prompt": [{"role": "user", "content": "What does x do?"}], "chosen": "It adds.",
                  "rejected": [{"role": "assistant", "content": "It sorts."}]}):
        chosen, rejected = fmt.pair(record(data))
        start = int(np.argmax(chosen.mask))
        assert start == int(np.argmax(rejected.mask)) and start > 0
        np.testing.assert_array_equal(chosen.ids[:start], rejected.ids[:start])
        assert chosen.mask[start:].all() and rejected.mask[start:].all()
    assert chosen.ids[-1] == fmt.tokenizer.eos_id  # the template ends the turn with <|im_end|>, the eos


def test_pair_whose_prompt_leaves_no_room_is_refused(fmt):
    group = fmt.pair(record({"prompt": "word " * 40, "chosen": "a", "rejected": "b"}))
    with pytest.raises(ConfigError, match="test record 1: its prompt fills the 16 tokens .* max_target_length=32"):
        fitted(group, 32, "test record 1")


def _batches(records, fmt, features, rows=4, length=96, seed=0):
    return record_batches(records, features, pad_id=fmt.tokenizer.pad_id, seq_len=length, global_batch_rows=rows,
                          seed=seed)


def test_packed_rows_keep_every_conversation_whole_with_its_mask(tmp_path, fmt):
    path = write_jsonl(conversations(24), tmp_path / "sft.jsonl")
    records = JsonlRecords([str(path)])
    batch = next(iter(_batches(records, fmt, fmt.conversation, length=256)))
    expected = {}  # every conversation's tokens, to find each packed segment among them
    for i in range(len(records)):
        (tokens,) = fitted(fmt.conversation(records[i]), 256, "")
        expected[tuple(tokens.ids[:-1].tolist())] = (tokens.ids[1:], tokens.mask[1:])
    assert batch["segment_ids"].max() >= 2  # rows pack several conversations
    for row in range(4):
        segments = batch["segment_ids"][row]
        for segment in set(segments.tolist()) - {0}:
            where = np.flatnonzero(segments == segment)
            np.testing.assert_array_equal(batch["positions"][row, where], np.arange(len(where)))
            targets, mask = expected[tuple(batch["inputs"][row, where].tolist())]  # a whole conversation
            np.testing.assert_array_equal(batch["targets"][row, where], targets)
            np.testing.assert_array_equal(batch["loss_mask"][row, where], mask)
        padding = segments == 0
        assert not batch["loss_mask"][row, padding].any()


def test_pairs_share_a_row_as_consecutive_segments(tmp_path, fmt):
    path = write_jsonl(pairs(16), tmp_path / "dpo.jsonl")
    batch = next(iter(_batches(JsonlRecords([str(path)]), fmt, fmt.pair, length=160)))
    for row in range(4):
        segments = batch["segment_ids"][row]
        count = segments.max()
        assert count >= 2 and count % 2 == 0
        for k in range(1, count // 2 + 1):
            chosen, rejected = (np.flatnonzero(segments == s) for s in (2 * k - 1, 2 * k))
            first = [np.argmax(batch["loss_mask"][row, where]) for where in (chosen, rejected)]
            # the same prompt opens both
            np.testing.assert_array_equal(batch["inputs"][row, chosen[:first[0]]],
                                          batch["inputs"][row, rejected[:first[1]]])


def test_iterator_resumes_exactly(tmp_path, fmt):
    """A lane's position is one record index: restoring it (through JSON) gives the same next batches."""
    records = JsonlRecords([str(write_jsonl(conversations(30), tmp_path / "sft.jsonl"))])
    run = iter(_batches(records, fmt, fmt.conversation, rows=2))
    for _ in range(3):
        next(run)
    state = json.loads(json.dumps(run.get_state()))
    expected = [next(run) for _ in range(6)]  # crosses an epoch: 30 records over 2 lanes
    resumed = iter(_batches(records, fmt, fmt.conversation, rows=2))
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
