"""How a single-turn prompt becomes tokens, the one rendering sampling, the warm start, eval sets and
(through the batch's prompt ids) the trainer all use.

A prompt is a string or a list of chat messages ({"role", "content"}). With the chat template on
(`task.chat_template`: true, or "auto" where the tokenizer has one), it is rendered by the tokenizer's
own template with the assistant's turn opened (`add_generation_prompt`), after `task.system_prompt`
when set, and tokenised as rendered (the template writes its own special tokens). Off, a string is
tokenised as it is and a list's contents are joined by newlines (prl's tiny tokenizer has no template:
its prompts stay raw)."""

from __future__ import annotations


class PromptError(ValueError):
    """A prompt that cannot be rendered, in one line."""


def uses_template(tokenizer, setting) -> bool:
    """Whether prompts are rendered with the chat template (`setting`: task.chat_template)."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting is True and not has:
        raise PromptError("task.chat_template = true, but the model's tokenizer has no chat template: set it to "
                          "\"auto\" or false, or give a model folder whose tokenizer_config.json holds one")
    return has if setting == "auto" else bool(setting)


def messages(prompt, system: str | None = None) -> list[dict]:
    """The prompt as chat messages: a string is the user's message; `system` goes first unless the prompt has one."""
    out = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(check_messages(prompt))
    if system and not (out and out[0].get("role") == "system"):
        out.insert(0, {"role": "system", "content": system})
    return out


def check_messages(prompt) -> list[dict]:
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise PromptError(f"a prompt is a string or a list of messages with 'role' and 'content', got "
                          f"{type(prompt).__name__}: {str(prompt)[:80]}")
    return prompt


def render(tokenizer, msgs: list[dict], generation_prompt: bool) -> list[int]:
    """`msgs` in the tokenizer's chat template, as token ids; PromptError where the template refuses them (a
    template may raise, e.g. on a system message it does not take)."""
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # noqa: BLE001 - jinja's errors and the template's own raise_exception
        raise PromptError(f"the chat template cannot render the prompt: {type(e).__name__}: {e}") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def raw_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(str(m["content"]) for m in check_messages(prompt))


def prompt_ids(tokenizer, prompt, chat_template="auto", system_prompt: str | None = None) -> list[int]:
    """The token ids a single-turn prompt is sampled after."""
    if uses_template(tokenizer, chat_template):
        return render(tokenizer, messages(prompt, system_prompt), generation_prompt=True)
    return tokenizer(raw_text(prompt)).input_ids


def unknown_characters(tokenizer, prompts: list) -> list[str]:
    """The characters of `prompts` the tokenizer encodes as its unknown token (prl's tiny tokenizer knows a small
    alphabet: anything else silently becomes <unk>); empty for a tokenizer without one (byte-level BPE)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []
    chars = sorted({c for p in prompts for c in raw_text(p) if not c.isspace()})
    return [c for c in chars if unk in tokenizer(c, add_special_tokens=False).input_ids]
