"""vLLM's chat-template extras: add_generation_prompt, continue_final_message and
chat_template_kwargs render the prompt transformers' ``apply_chat_template`` renders (what vLLM
serves), and every bad combination is a 400 naming the field."""

from __future__ import annotations

import pytest

from pdd.config import ModelConfig
from pdd.errors import InvalidRequestError
from pdd.router.text.tokenizer import ChatOptions, TextCodec
from pdd.router.text.tool_prompt import ToolPlan, prompt_ids, prompt_text
from tests.router.test_api_tools import TOOLS

PREFILL = [
    {"role": "user", "content": "Name a primary color."},
    {"role": "assistant", "content": "The first primary color is"},
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer  # the router never imports it; the test may

    return AutoTokenizer.from_pretrained(str(ModelConfig().resolved_path()))


@pytest.mark.parametrize(
    "options",
    [ChatOptions(), ChatOptions(add_generation_prompt=False),
     ChatOptions(add_generation_prompt=False, continue_final_message=True)],
)  # fmt: skip
def test_the_prompt_equals_transformers_apply_chat_template(codec, hf_tokenizer, options):
    want = hf_tokenizer.apply_chat_template(
        PREFILL, tokenize=True, return_dict=False,
        add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message,
    )  # fmt: skip
    assert prompt_ids(codec, PREFILL, None, options) == list(want)


def test_continue_final_message_ends_inside_the_assistant_turn(codec):
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    assert prompt_text(codec, PREFILL, None, options).endswith(
        "<|im_start|>assistant\nThe first primary color is"
    )


def test_chat_template_kwargs_reach_the_template(codec):
    thinking = TextCodec(
        codec._tok, {},
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}",
    )  # fmt: skip
    off = ChatOptions(template_kwargs={"enable_thinking": False})
    assert prompt_text(thinking, PREFILL[:1], None, off).endswith("/no_think")
    assert not prompt_text(thinking, PREFILL[:1], None).endswith("/no_think")


@pytest.mark.parametrize(
    ("make", "param"),
    [(lambda: ChatOptions(continue_final_message=True), "continue_final_message"),
     (lambda: ChatOptions(template_kwargs={"messages": []}), "chat_template_kwargs")],
)  # fmt: skip
def test_bad_options_are_400(make, param):
    with pytest.raises(InvalidRequestError) as info:
        make()
    assert info.value.param == param


def test_continuing_needs_an_assistant_message_last(codec):
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(InvalidRequestError) as info:
        prompt_text(codec, PREFILL[:1], None, options)
    assert info.value.param == "continue_final_message"


def test_a_forced_tool_call_needs_the_generation_prompt(codec):
    plan = ToolPlan("hermes", tuple(TOOLS), "required")
    with pytest.raises(InvalidRequestError) as info:
        prompt_text(codec, PREFILL, plan, ChatOptions(add_generation_prompt=False))
    assert info.value.param == "tool_choice"
