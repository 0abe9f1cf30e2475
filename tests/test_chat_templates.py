"""Chat templates a run brings. --data.chat_template_kwargs (TRL's chat_template_kwargs, e.g. Qwen3's
enable_thinking): every chat-template rendering -- training prompts, a tool conversation's turns, a reward
model's inputs -- gets them, token for token as the template renders with them; from TRL's field and from
the command line into a run. --data.chat_template (OpenRLHF's --tokenizer_chat_template): the template
itself or a file, used for the prompts and saved with the trained model; a bad one is one line."""
from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from rlhf_plugins.models.tiny_model import CHAT_TEMPLATE
from tests.helpers import make_reward_model, short_run, the_run

#: the tiny model's template, except that with enable_thinking false every assistant turn opens with an
#: empty "thinking" marker (as Qwen3's puts an empty <think></think> block)
QUIET = "{% if enable_thinking is defined and not enable_thinking %}<|system|>{% endif %}"
TEMPLATE = CHAT_TEMPLATE.replace("<|assistant|>{{ message['content'] }}", "<|assistant|>" + QUIET + "{{ message['content'] }}")
TEMPLATE = TEMPLATE.replace("{% if add_generation_prompt %}<|assistant|>", "{% if add_generation_prompt %}<|assistant|>" + QUIET)
KWARGS = {"enable_thinking": False}
ROWS = [{"prompt": [{"role": "user", "content": "3+4="}], "label": "7"}, {"prompt": "1+1=", "label": "2"}]


def with_template(folder: Path, source: str | Path) -> Path:
    """A copy of the model folder ``source`` whose tokenizer has :data:`TEMPLATE`."""
    from transformers import AutoTokenizer

    shutil.copytree(source, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model) -> Path:
    return with_template(tmp_path_factory.mktemp("quiet") / "model", tiny_model)


@pytest.fixture(scope="module")
def tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def marker(tok) -> int:
    return tok.convert_tokens_to_ids("<|system|>")


def test_prompts_render_with_the_kwargs_as_trl_does(tok):
    """Through TRL's field: conversational prompts are TRL's apply_chat_template(..., **kwargs) token for
    token; without the field they lack the marker; standard (string) prompts are not templated at all."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.data.prompts import load_prompts
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    raw, notes = from_grpo_fields({"chat_template_kwargs": KWARGS})
    assert not any("chat_template_kwargs" in n for n in notes)
    config, _, _ = prepare(raw, autoload=False)
    assert config.data.chat_template_kwargs == KWARGS
    ours = load_prompts(config.data, tok, rows=ROWS).prompt_ids
    trl = tok.apply_chat_template([ROWS[0]["prompt"]], add_generation_prompt=True, tokenize=True, return_dict=True,
                                  **KWARGS)["input_ids"][0]
    assert ours[0] == trl and trl[-1] == marker(tok)
    assert ours[1] == tok("1+1=")["input_ids"]
    plain, _, _ = prepare(from_grpo_fields({})[0], autoload=False)
    without = load_prompts(plain.data, tok, rows=ROWS).prompt_ids[0]
    assert without == ours[0][:-1] and marker(tok) not in without


def test_a_system_prompt_opens_every_templated_prompt_unless_it_has_its_own(tiny_model):
    """--data.system_prompt: a string prompt becomes [system, user], a chat prompt gets the system message first,
    one that opens with its own keeps it; the token ids are the template's rendering of those messages. Where no
    prompt is templated (TRL's standard prompts) it is one line, as is the flag without the chat template."""
    from transformers import AutoTokenizer

    from rlhf_plugins.api import prepare
    from rlhf_plugins.data.prompts import load_prompts
    from rlhf_plugins.errors import ConfigError, DataError

    tok = AutoTokenizer.from_pretrained(tiny_model)
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    config, _, _ = prepare({"data": {"system_prompt": "Add."}}, autoload=False)
    got = load_prompts(config.data, tok, rows=[*ROWS, {"prompt": own, "label": "4"}])
    system = {"role": "system", "content": "Add."}
    assert got.prompts == [[system, *ROWS[0]["prompt"]], [system, {"role": "user", "content": "1+1="}], own]
    assert got.prompt_ids[1] == tok.apply_chat_template(got.prompts[1], add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"]
    standard, _, _ = prepare({"data": {"system_prompt": "Add.", "template_strings": False}}, autoload=False)
    with pytest.raises(DataError, match="data.system_prompt opens the prompts the chat template renders, but every "
                                        "prompt of 'the given rows' is plain text"):
        load_prompts(standard.data, tok, rows=ROWS[1:])
    with pytest.raises(ConfigError, match="data.system_prompt is a chat message, which only the chat template"):
        prepare({"data": {"system_prompt": "Add.", "apply_chat_template": False}}, autoload=False)


def test_trls_json_text_form_is_read_and_anything_else_is_one_line():
    """transformers reads a dict field given on a command line as JSON text; so do we."""
    from rlhf_plugins.errors import ConfigError
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    raw, _ = from_grpo_fields({"chat_template_kwargs": '{"enable_thinking": false}'})
    assert raw["data"]["chat_template_kwargs"] == KWARGS
    for bad in ("[1]", "{bad"):
        with pytest.raises(ConfigError, match="TRL field 'chat_template_kwargs' expects mapping"):
            from_grpo_fields({"chat_template_kwargs": bad})


def test_tool_turns_and_prompts_of_a_conversation_render_with_the_kwargs(tok):
    from rlhf_plugins.environments.sessions import SessionContext, _Session
    from rlhf_plugins.environments.tools import Renderer

    follow_up = [{"role": "tool", "content": "7"}]
    assert Renderer(tok, KWARGS).suffix_ids(follow_up) == Renderer(tok).suffix_ids(follow_up) + [marker(tok)]
    session = _Session("calc", None, SessionContext(tok, None, None, True, dict(KWARGS)), {}, "row 1")
    text = session.render_prompt("3+4=", None, None)
    assert text == tok.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True,
                                           tokenize=False, **KWARGS)
    assert text.endswith("<|assistant|><|system|>")


def test_a_reward_models_inputs_render_with_the_kwargs(tmp_path, tiny_model):
    from rlhf_plugins.models.reward_model import RewardModelScorer

    folder = with_template(tmp_path / "rm", make_reward_model(tmp_path / "rm0", "trl", seed=1))
    quiet, plain = RewardModelScorer(str(folder), template_kwargs=KWARGS), RewardModelScorer(str(folder))
    for finished in (True, False):
        ids = quiet.render("3+4=", "7", finished)
        expected = plain.render("3+4=", "7", finished)
        at = expected.index(plain.tokenizer.convert_tokens_to_ids("<|assistant|>")) + 1
        assert ids == expected[:at] + [marker(quiet.tokenizer)] + expected[at:]


def test_the_kwargs_reach_the_engine_in_a_run(rlhf, model, tmp_path):
    """From the command line (a YAML mapping): the prompts the engine sampled from end with the marker."""
    hook, seen = seen_prompts_plugin(tmp_path)
    code, _, err = rlhf("train", "--model.path", str(model), "--plugin", str(hook),
                        "--data.chat_template_kwargs", "{enable_thinking: false}", *short_run("--train.steps", "1"))
    assert code == 0, err
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [ids for line in seen.read_text().splitlines() for ids in json.loads(line)]
    assert prompts and all(ids[-2:] == [tok.convert_tokens_to_ids("<|assistant|>"), marker(tok)] for ids in prompts)


def seen_prompts_plugin(tmp_path: Path) -> tuple[Path, Path]:
    """A plugin file recording the prompt ids of every rollout, and the file it writes."""
    seen = tmp_path / "seen.json"
    hook = tmp_path / "seen_prompts.py"
    hook.write_text(textwrap.dedent(f"""
        import json
        from rlhf_plugins import hookimpl
        @hookimpl
        def rlhf_after_rollout(step, rollout):
            with open({str(seen)!r}, "a") as f:
                f.write(json.dumps(rollout.prompt_ids) + "\\n")
    """))
    return hook, seen


@pytest.mark.parametrize("as_file", [False, True])
def test_a_template_of_the_runs_own_renders_the_prompts_and_is_saved(rlhf, tmp_path, as_file):
    """The tiny model's template with a marker after the generation prompt, as text or as a file: the
    prompts the engine sampled from end with it, and final/'s tokenizer carries the template."""
    template = CHAT_TEMPLATE.replace("{% if add_generation_prompt %}<|assistant|>",
                                     "{% if add_generation_prompt %}<|assistant|><|system|>")
    value = template
    if as_file:
        value = str(tmp_path / "template.jinja")
        Path(value).write_text(template)
    hook, seen = seen_prompts_plugin(tmp_path)
    code, _, err = rlhf("train", "--plugin", str(hook), "--data.chat_template", value,
                        *short_run("--train.steps", "1"))
    assert code == 0, err
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(the_run() / "final")
    assert saved.chat_template == template
    prompts = [ids for line in seen.read_text().splitlines() for ids in json.loads(line)]
    assert prompts and all(ids[-2:] == [saved.convert_tokens_to_ids("<|assistant|>"), marker(saved)] for ids in prompts)


@pytest.mark.parametrize("value, message", [
    ("{% if %}", "data.chat_template does not render a user message: TemplateSyntaxError"),
    ("{{ raise_exception('no user turns') }}", "data.chat_template does not render a user message: "),
    ("chat.jinja", "data.chat_template 'chat.jinja' is neither a file nor a Jinja template"),
])
def test_a_bad_template_is_one_line_and_leaves_nothing(rlhf, value, message):
    code, _, err = rlhf("train", "--data.chat_template", value, *short_run())
    assert code == 2 and err.strip().count("\n") == 0, err
    assert message in err
    assert not Path("runs").exists()
