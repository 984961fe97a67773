"""Assistant masks for chat templates without generation tags come from character offsets;
chat-template renders are remembered where that gives the same text."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from app.common.inputs import InputPreparer
from app.common.masks import assistant_spans_by_prefixes
from app.common.turns import continuation_text

CONVERSATION = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo yo"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "fine"},
]


def untagged_copy(model_dir, template: str):  # type: ignore[no-untyped-def]
    """The tokenizer with `template` stripped of its generation tags."""
    plain = AutoTokenizer.from_pretrained(model_dir)
    plain.chat_template = template.replace("{%- generation %}", "").replace(
        "{%- endgeneration %}", ""
    )
    return plain


def test_offset_mask_equals_generation_tag_mask(model_dir):
    tagged = AutoTokenizer.from_pretrained(model_dir)
    plain = untagged_copy(model_dir, tagged.chat_template)
    with_tags = InputPreparer(tagged, vocab_size=259, max_model_len=4096)
    without = InputPreparer(plain, vocab_size=259, max_model_len=4096)
    assert with_tags.has_generation_tags and not without.has_generation_tags
    a = with_tags.template(CONVERSATION, generation_prompt=False)
    b = without.template(CONVERSATION, generation_prompt=False)
    assert a.ids == b.ids
    assert b.assistant_mask == a.assistant_mask
    assert sum(a.assistant_mask or []) == len("yo yo") + 1 + len("fine") + 1


def test_tags_closing_before_the_end_of_turn_still_mask_it_and_every_byte(model_dir):
    """A template whose generation tags close before `<|im_end|>`, and replies ending on a
    multi-byte character: the mask covers every byte of the reply and its end-of-turn token,
    as the untagged template's does (transformers' tag mask alone misses both)."""
    early = AutoTokenizer.from_pretrained(model_dir)
    early.chat_template = early.chat_template.replace(
        "{{- '<|im_end|>' }}{%- endgeneration %}", "{%- endgeneration %}{{- '<|im_end|>' }}"
    )
    plain = untagged_copy(model_dir, early.chat_template)
    tagged = InputPreparer(early, vocab_size=259, max_model_len=4096)
    untagged = InputPreparer(plain, vocab_size=259, max_model_len=4096)
    assert tagged.has_generation_tags
    chat = [
        {"role": "user", "content": "coffee?"},
        {"role": "assistant", "content": "un café ☕"},
        {"role": "user", "content": "thé?"},
        {"role": "assistant", "content": "oui ✓"},
    ]
    a = tagged.template(chat, generation_prompt=False)
    b = untagged.template(chat, generation_prompt=False)
    assert a.ids == b.ids and a.assistant_mask == b.assistant_mask
    written = len("un café ☕".encode()) + 1 + len("oui ✓".encode()) + 1
    assert sum(a.assistant_mask or []) == written
    end_of_turn = early.convert_tokens_to_ids("<|im_end|>")
    ends = [i for i, t in enumerate(a.ids) if t == end_of_turn]
    assert [a.assistant_mask[i] for i in ends] == [0, 1, 0, 1]  # user turns' ends are not


# Templates written the way real models ship them: no generation tags.
QWEN_LIKE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m['content'] }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Reasoning of assistant turns before the last user message is dropped.
REASONING_LIKE = (
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA_LIKE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
AGENT_TURNS = [
    {"role": "user", "content": "What is 17*23? Use the tool."},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "python", "code": "17*23"}\n</tool_call>',
    },
    {"role": "tool", "content": "391"},
    {"role": "assistant", "content": "It is 391."},
    {"role": "user", "content": "And 2+2?"},
    {"role": "assistant", "content": "4"},
]


def preparer_with(model_dir, template: str) -> InputPreparer:  # type: ignore[no-untyped-def]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = template
    return InputPreparer(tokenizer, vocab_size=259, max_model_len=1 << 16)


def prefix_method_mask(preparer: InputPreparer, conversation, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    spans = assistant_spans_by_prefixes(preparer, conversation, text)
    encoded = preparer.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [int(any(s < b and a < e for s, e in spans)) for a, b in encoded["offset_mapping"]]


@pytest.mark.parametrize("template", [QWEN_LIKE, LLAMA_LIKE], ids=["qwen-like", "llama-like"])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_linear_mask_equals_the_per_turn_prefix_mask(model_dir, template, generation_prompt):
    preparer = preparer_with(model_dir, template)
    conversation = AGENT_TURNS if not generation_prompt else AGENT_TURNS[:-1]
    prepared = preparer.template(conversation, generation_prompt=generation_prompt)
    expected = prefix_method_mask(preparer, conversation, prepared.text or "")
    assert prepared.assistant_mask == expected
    # every assistant message is covered, and nothing else is
    text = prepared.text or ""
    masked = "".join(
        text[a:b]
        for (a, b), m in zip(
            preparer.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)[
                "offset_mapping"
            ],
            expected,
            strict=True,
        )
        if m
    )
    contents = [m["content"] for m in conversation if m["role"] == "assistant"]
    end = "<|im_end|>" if template == QWEN_LIKE else "<|eot_id|>"
    assert masked == "".join(c + end for c in contents)


def test_masks_take_a_constant_number_of_renders(model_dir):
    preparer = preparer_with(model_dir, QWEN_LIKE)
    calls = 0
    render = preparer.render

    def counting(conversation, *, generation_prompt, tools=None, options=None):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return render(
            conversation, generation_prompt=generation_prompt, tools=tools, options=options
        )

    preparer.render = counting  # type: ignore[method-assign]
    for num_turns in (2, 40):
        calls = 0
        conversation = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
            for i in range(num_turns)
        ]
        prepared = preparer.template(conversation, generation_prompt=False)
        assert sum(prepared.assistant_mask or []) == sum(
            len(f"turn {i}") + 1 for i in range(1, num_turns, 2)
        )
        assert calls <= 5, f"{calls} renders for {num_turns} turns"


def test_turns_whose_reasoning_the_template_drops(model_dir):
    preparer = preparer_with(model_dir, REASONING_LIKE)
    conversation = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nagain\n</think>\n6"},
    ]
    prepared = preparer.template(conversation, generation_prompt=False)
    text = prepared.text or ""
    assert "add them" not in text and "again" in text  # the template dropped the first reasoning
    ids = prepared.ids
    masked = preparer.decode(
        [t for t, m in zip(ids, prepared.assistant_mask or [], strict=True) if m]
    )
    assert masked == "4<|im_end|>" + "<think>\nagain\n</think>\n6<|im_end|>"


def counted_renders(preparer: InputPreparer) -> list[int]:
    """A one-item list counting the tokenizer's own chat-template renders from now on."""
    count = [0]
    tokenizer = preparer.tokenizer
    render = tokenizer.apply_chat_template

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        count[0] += 1
        return render(*args, **kwargs)

    tokenizer.apply_chat_template = counting
    return count


def test_an_episodes_next_turn_reuses_the_render_of_its_last(model_dir):
    """continuation_text renders the history, then the history with the new turn: the next
    turn's history is that second conversation, so each turn after the first renders once;
    every continuation equals the one fresh renders give."""
    preparer = preparer_with(model_dir, QWEN_LIKE)
    plain = AutoTokenizer.from_pretrained(model_dir)
    plain.chat_template = QWEN_LIKE
    renders = counted_renders(preparer)
    history: list[dict[str, str]] = [{"role": "user", "content": "2 + 2?"}]
    for turn in range(6):
        action, reply = f"answer {turn}", [{"role": "user", "content": f"wrong ({turn})"}]
        text = continuation_text(preparer, history, action, reply)
        turned = [*history, {"role": "assistant", "content": action}, *reply]
        prompt = plain.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        after = plain.apply_chat_template(turned, tokenize=False, add_generation_prompt=True)
        assert prompt + action + text == after
        history = turned
    assert renders[0] == 2 + 5


def test_templates_that_read_the_clock_render_every_time(model_dir):
    dated = "{{- strftime_now('%Y') }}{{- '<|im_start|>' + m['role']"
    preparer = preparer_with(model_dir, QWEN_LIKE.replace("{{- '<|im_start|>' + m['role']", dated))
    assert "strftime_now" in preparer.tokenizer.chat_template
    renders = counted_renders(preparer)
    for _ in range(3):
        preparer.render(CONVERSATION, generation_prompt=True)
    assert renders[0] == 3


def test_a_replaced_template_is_rendered_afresh(model_dir):
    preparer = preparer_with(model_dir, QWEN_LIKE)
    before = preparer.render(CONVERSATION, generation_prompt=True)
    assert preparer.render(CONVERSATION, generation_prompt=True) == before
    preparer.tokenizer.chat_template = QWEN_LIKE.replace("<|im_start|>", "<|im_start|> ")
    after = preparer.render(CONVERSATION, generation_prompt=True)
    assert after != before and "<|im_start|> user" in after


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_equals_the_tokenizers_own(model_dir, clean_up):
    """Decoding goes straight to the fast tokenizer where transformers would add nothing to
    it, and through transformers where it cleans up spaces: the text is the same either way."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.clean_up_tokenization_spaces = clean_up
    preparer = InputPreparer(tokenizer, vocab_size=len(tokenizer), max_model_len=4096)
    assert (preparer._plain_decoder is None) == clean_up
    rng = random.Random(0)
    rows = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 40))] for _ in range(64)]
    rows.append(tokenizer("a , b .<|im_end|>x é")["input_ids"])
    for ids in rows:
        for skip in (False, True):
            assert preparer.decode(ids, skip_special=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )


ROLES_BY_NAME = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{{- '<<SYS>>' + m['content'] + '<</SYS>>' }}"
    "{%- elif m['role'] == 'user' %}{{- '[U]' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}{{- '[A]' + m['content'] + '[/A]' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '[A]' }}{%- endif %}"
)


def test_a_developer_message_is_never_dropped(model_dir):
    """A template that renders the roles it names (and drops any other) gets OpenAI's
    developer message as a system one; the history keeps the role as sent."""
    preparer = preparer_with(model_dir, ROLES_BY_NAME)
    conversation = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
    ]
    prepared = preparer.template(conversation, generation_prompt=True)
    assert prepared.text == "<<SYS>>Answer in French.<</SYS>>[U]Hi[A]"
    assert prepared.history == conversation
    # A template that names the developer role gets it as it is.
    knowing = preparer_with(model_dir, ROLES_BY_NAME.replace("'system'", "'developer'"))
    assert knowing.template(conversation, generation_prompt=True).text.startswith("<<SYS>>")


async def test_roles_must_be_ones_templates_know(client):
    body = {"messages": [[{"role": "0", "content": "Hi"}]], "max_new_tokens": 1}
    refused = await client.post("/v1/generate", json=body)
    assert refused.status_code == 422 and "role" in refused.json()["error"]["param"]
