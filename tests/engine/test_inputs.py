"""Assistant masks for chat templates without generation tags come from character offsets."""

from __future__ import annotations

from transformers import AutoTokenizer

from app.common.inputs import InputPreparer

CONVERSATION = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo yo"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "fine"},
]


def test_offset_mask_equals_generation_tag_mask(model_dir):
    tagged = AutoTokenizer.from_pretrained(model_dir)
    plain = AutoTokenizer.from_pretrained(model_dir)
    plain.chat_template = tagged.chat_template.replace("{%- generation %}", "").replace(
        "{%- endgeneration %}", ""
    )
    with_tags = InputPreparer(tagged, vocab_size=259, max_model_len=4096)
    without = InputPreparer(plain, vocab_size=259, max_model_len=4096)
    assert with_tags.has_generation_tags and not without.has_generation_tags
    a = with_tags.template(CONVERSATION, generation_prompt=False)
    b = without.template(CONVERSATION, generation_prompt=False)
    assert a.ids == b.ids
    assert b.assistant_mask == a.assistant_mask
    assert sum(a.assistant_mask or []) == len("yo yo") + 1 + len("fine") + 1
