"""Agentic environments (issue 21) against a real inference server: a tiny model trained here until it
calls tools on its own serves the episodes; tokens trained must be the tokens sampled, environment
tokens masked, versions and routing kept per token across turns; tools that fail, hang or flood and
calls the model got wrong never take a rollout down."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from prl.backends.embedded import EmbeddedBackend
from prl.envs import make_env
from prl.envs.formats import ChatFormat, TinyFormat
from prl.envs.tools import load_tool, tool_schema
from prl.model.tiny import char_tokenizer
from prl.launch.configs import resolve
from prl.recipe.resolve import write_configs, write_secret
from prl.recipe.schema import Recipe
from prl.transport.batch import Sample, pack

RECIPE = {
    "task": {"name": "custom", "dataset": "test_envs:two_calls", "reward": "prl.tasks.lookup:reward",
             "min_len": 3, "max_len": 3},
    "env": {"kind": "tools", "tools": ["prl.tasks.lookup:get", "test_envs:raises", "test_envs:hangs",
                                       "test_envs:floods"], "max_turns": 4, "max_total_tokens": 96,
            "tool_timeout_s": 1.0, "max_env_chars": 64},
    "sampling": {"temperature": 0.0, "max_tokens": 16},
    "trainer": {"router_replay": True},
    "model": {"max_position_embeddings": 256},
}


def two_calls(index: int, seed: int, min_len: int, max_len: int) -> dict:
    """Look a key up twice (the second time for its first half), then answer the first code."""
    from prl.tasks.lookup import dataset

    ex = dataset(index % 2, 0, min_len, max_len)
    key = ex["prompt"].removeprefix("key:").removesuffix("=")
    return {**ex, "calls": [["get", {"key": key}], ["get", {"key": key[:2]}]]}


def raises(x: str) -> str:
    """Always fails."""
    raise RuntimeError(f"no {x}")


def hangs(x: str) -> str:
    time.sleep(3600)
    return x


def floods(n: int) -> str:
    return "z" * (10 << 20)


def overfit(model_dir, env, examples: int = 2, steps: int = 300) -> None:
    """Train the tiny model on the environment's demonstrations until it reproduces them greedily,
    and save it where the server loads weights from."""
    from safetensors.torch import save_model

    from prl.model.build import build_model
    from prl.trainer.loss import token_logprobs

    model = build_model(model_dir, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    samples = [Sample(d.prompt_ids, d.completion_ids, [0.0] * len(d.mask), [0] * len(d.mask), 1.0, mask=d.mask)
               for d in (env.demonstration(i) for i in range(examples))]
    [mb] = pack(samples, 1, 4096)[0]
    for _ in range(steps):
        out = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
        logits = out.logits[0][mb.loss_mask]
        if bool((logits.argmax(-1) == mb.target_ids[mb.loss_mask]).all()):
            break
        loss = -token_logprobs(out.logits[0], mb.target_ids)[mb.loss_mask].mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    save_model(model, str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(recipe, run_dir, backend factory) for a real server on a model that makes two tool calls."""
    from prl.model.tiny import write_model_dir

    run_dir = tmp_path_factory.mktemp("envs")
    recipe = Recipe.model_validate(RECIPE)
    write_model_dir(recipe.model, run_dir / "model")
    env = make_env(recipe.env, recipe.task, 0, char_tokenizer(), recipe.sampling, 1, False)
    overfit(run_dir / "model", env)
    configs = resolve(recipe, run_dir, write_secret(run_dir))
    write_configs(configs, run_dir)
    cfg = next(c for c in configs if c.role == "inference")
    proc = subprocess.Popen([sys.executable, "-m", "prl.inference", "--config", cfg.config_path],
                            stdout=open(run_dir / "server.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})
    url = f"http://{cfg.host}:{cfg.port}"
    asyncio.run(EmbeddedBackend(url, cfg.secret()).wait_ready(120))
    yield recipe, run_dir, lambda: EmbeddedBackend(url, cfg.secret())
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


class Recording:
    """The real backend, with every response kept (what was sampled, to compare with what trains)."""

    def __init__(self, backend, between_turns=None):
        self.backend, self.requests, self.responses, self.between = backend, [], [], between_turns

    async def generate(self, req, conversation=None):
        if self.responses and self.between:
            await self.between(len(self.responses))
        self.requests.append(req)
        resp = await self.backend.generate(req)
        self.responses.append(resp)
        return resp


def episode(served, between=None, group: int = 1):
    recipe, _, make = served
    env = make_env(recipe.env, recipe.task, 0, char_tokenizer(), recipe.sampling, group, True)

    async def go():
        sampler = Recording(make(), between)
        trajs = await env.rollout(env.example(0), sampler)
        await sampler.backend.close()
        return env, trajs, sampler.responses

    return asyncio.run(go())


def test_each_request_says_whether_a_later_turn_can_extend_it(served):
    """`final` (the engine then keeps none of the completions' KV): a single-turn rollout's request, and a
    conversation's last allowed turn only."""
    recipe, _, make = served

    def finals(env_cfg, group: int) -> list[bool]:
        env = make_env(env_cfg, recipe.task, 0, char_tokenizer(), recipe.sampling, group, True)

        async def go():
            sampler = Recording(make())
            await env.rollout(env.example(0), sampler)
            await sampler.backend.close()
            return [r.final for r in sampler.requests]

        return asyncio.run(go())

    assert finals(recipe.env.model_copy(update={"max_turns": 3}), 1) == [False, False, True]
    assert finals(recipe.env.model_copy(update={"kind": "single_turn"}), 2) == [True]


def test_a_three_turn_tool_trajectory_trains_exactly_the_sampled_ids(served):
    env, [t], responses = episode(served)
    assert t.info["turns"] == 3 and t.info["tool_calls"] == 2 and not t.info.get("tool_errors"), (
        t.info, char_tokenizer().decode(t.completion_ids))
    assert t.reward == 1.0, char_tokenizer().decode(t.completion_ids)
    sampled = [i for r in responses for i in r.completions[0].token_ids]
    [[mb]] = pack([Sample(t.prompt_ids, t.completion_ids, t.logprobs, t.versions, 1.0, mask=t.mask)], 1, 4096)
    assert mb.target_ids[mb.loss_mask].tolist() == sampled  # byte for byte, nothing re-tokenised
    env_ids = [i for i, m in zip(t.completion_ids, t.mask) if not m]
    fmt = TinyFormat(char_tokenizer())
    key = env.example(0)["calls"][0][1]["key"]
    assert env_ids == fmt.reply_ids("tool", load_tool("prl.tasks.lookup:get").fn(key)) + fmt.reply_ids(
        "tool", load_tool("prl.tasks.lookup:get").fn(key[:2]))
    assert all(v == -1 for v, m in zip(t.versions, t.mask) if not m)
    logps = [lp for r in responses for lp in r.completions[0].logprobs]
    assert mb.infer_logprobs[mb.loss_mask].tolist() == pytest.approx(logps)
    # the trainer's forward over the packed row gives the engine's logprobs (the engine reused its
    # cached history between turns; the trainer computes the whole row at once)
    from prl.model.build import build_model
    from prl.trainer.loss import token_logprobs

    model = build_model(served[1] / "model")
    with torch.no_grad():
        out = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
    mine = token_logprobs(out.logits[0], mb.target_ids)[mb.loss_mask]
    assert torch.allclose(mine, mb.infer_logprobs[mb.loss_mask], atol=1e-4), (mine - mb.infer_logprobs[mb.loss_mask])


def test_routing_covers_every_input_token_across_turns(served):
    """R3: the engine's routing for prompt, model and environment tokens, collected turn by turn,
    equals what one prefill of the whole history gives."""
    recipe, _, make = served
    _, [t], _ = episode(served)
    assert t.routing is not None and t.routing.shape[0] == len(t.prompt_ids) + len(t.completion_ids) - 1

    async def fresh():
        from prl.inference.protocol import GenerateRequest, decode_routing

        b = make()
        r = await b.generate(GenerateRequest(prompt_ids=t.prompt_ids + t.completion_ids, max_tokens=1,
                                             temperature=0.0, return_routing=True))
        await b.close()
        return decode_routing(r.prompt_routing)

    whole = asyncio.run(fresh())
    assert torch.equal(whole[:-1], t.routing)


def test_a_trajectory_spans_a_weight_update_with_per_token_versions(served):
    """New weights land between turn 1 and turn 2: turn 1's tokens keep the version that produced
    them, later turns carry the new one, and the staleness rule sees the oldest."""
    from prl.model.weights import write_weights
    from prl.orchestrator.buffer import Group

    recipe, run_dir, make = served
    from prl.model.build import build_model

    state = build_model(run_dir / "model").state_dict()
    folder = write_weights(run_dir / "weights" / "v7", state, {"version": 7})

    async def update(turn):
        if turn == 1:
            b = make()
            await b.update_weights(7, str(folder))
            await b.close()

    _, [t], _ = episode(served, between=update)
    model_versions = [v for v, m in zip(t.versions, t.mask) if m]
    first = t.mask.index(0)  # turn 1 ends where the first environment token starts
    assert set(model_versions[:first]) == {-1} and set(model_versions[first:]) == {7}, model_versions
    group = Group(0, [Sample(t.prompt_ids, t.completion_ids, t.logprobs, t.versions, 0.0, mask=t.mask)])
    assert group.min_version == -1 and group.max_version == 7


@pytest.mark.parametrize("text,error,counted", [
    ("call:raises abc", "raised RuntimeError: no abc", "tool_error.raised"),
    ("call:hangs abc", "took longer than 1 s", "tool_error.timeout"),
    ("call:nosuch abc", "unknown tool 'nosuch'", "tool_error.unknown_tool"),
    ("call:get abc def", "get takes 1 argument(s), got 2", "tool_error.malformed"),
    ("call:floods 5", "[cut at 64 of 10485760 chars]", None),
    ("call:floods five", "argument 'n' must be integer", "tool_error.bad_arguments"),
])
def test_tool_failures_are_answered_to_the_model_and_counted(served, text, error, counted):
    """Each is the environment's reply to one model turn; the rollout goes on."""
    from prl.envs.multi_turn import Episode

    recipe, _, _ = served
    env = make_env(recipe.env, recipe.task, 0, char_tokenizer(), recipe.sampling, 1, False)
    ep = Episode([1])
    reply = asyncio.run(env.respond(ep, text, env.example(0)))
    assert reply and error in ep.replies[0], ep.replies
    assert char_tokenizer().decode(reply).startswith(" res:")  # the model reads it as a tool's answer
    assert ep.stats["tool_calls"] == 1
    assert (ep.stats[counted] == 1 and ep.stats["tool_errors"] == 1) if counted else ep.stats["tool_errors"] == 0


CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer():
    """A tokenizer with a chat template following the Qwen3 / GLM tool-call convention."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    specials = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<unk>"]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", unk_token="<unk>",
                                  additional_special_tokens=specials[:4])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_chat_format_parses_qwen_tool_calls_and_renders_results_as_the_template_does():
    tok = chat_tokenizer()
    fmt = ChatFormat(tok)
    tool = load_tool("prl.tasks.lookup:get")
    assert "tools: get" in tok.decode(fmt.prompt_ids("key:ab=", [tool]))
    text = 'x <tool_call>\n{"name": "get", "arguments": {"key": "ab"}}\n</tool_call> <tool_call>{bad json}</tool_call>'
    good, bad = fmt.parse_calls(text, {"get": tool})
    assert (good.name, good.args, good.error) == ("get", {"key": "ab"}, None)
    assert bad.error and "unreadable tool call" in bad.error
    reply = tok.decode(fmt.reply_ids("tool", "c0de"))
    assert reply == "\n<|im_start|>user\n<tool_response>\nc0de\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    call = fmt.call_text("get", {"key": "ab"})
    assert call in text  # renders a call as the model writes one: parsing it gives the call back
    [again] = fmt.parse_calls(call, {"get": tool})
    assert (again.name, again.args, again.error) == ("get", {"key": "ab"}, None)
    schema = tool_schema("floods", floods)
    assert schema["parameters"] == {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_a_history_the_template_would_tokenise_differently_is_kept_and_counted_as_a_fork():
    """prl trains the ids it sampled; a framework that renders the conversation with the chat template
    and tokenises it again trains others wherever they differ. Here the model spelled `<tool_call>` out
    in characters: the same text, but the template's tokenizer makes it one special token."""
    from prl.envs.multi_turn import Episode
    from prl.envs.stats import summarize
    from prl.recipe.schema import Recipe

    tok = chat_tokenizer()
    r = Recipe.model_validate({"task": {"name": "custom", "dataset": "prl.tasks.lookup:dataset",
                                        "reward": "prl.tasks.lookup:reward"},
                               "env": {"kind": "tools", "format": "chat", "tools": ["prl.tasks.lookup:get"],
                                       "max_total_tokens": 256}, "sampling": {"max_tokens": 64}})
    env = make_env(r.env, r.task, 0, tok, r.sampling, 1, False)
    example = env.example(0)
    key = example["prompt"].removeprefix("key:").removesuffix("=")

    def played(call_ids):
        ep = Episode(env.prompt_ids(example))
        for k, ids in enumerate([call_ids + [tok.eos_token_id], tok(example["answer"]).input_ids + [tok.eos_token_id]]):
            ep.ids += ids
            ep.mask += [1] * len(ids)
            ep.turns += 1
            ep.turn_texts.append(tok.decode(ids[:-1], skip_special_tokens=False))
            if k == 0:
                ep.replies.append(load_tool("prl.tasks.lookup:get").fn(key))
                reply = env.fmt.reply_ids("tool", ep.replies[-1])
                ep.ids += reply
                ep.mask += [0] * len(reply)
        env.count_fork(ep, example)
        return env.info(ep)

    call = env.fmt.call_text("get", {"key": key})
    as_tokens = tok(call, add_special_tokens=False).input_ids
    body = call.removeprefix("<tool_call>").removesuffix("</tool_call>")  # the call's JSON between the markers
    spelled = [tok.convert_tokens_to_ids(c) for c in "<tool_call>"] + tok(body).input_ids + as_tokens[-1:]
    assert tok.decode(spelled) == tok.decode(as_tokens) and spelled != as_tokens
    infos = [played(as_tokens), played(spelled)]
    assert [i["retokenize_forks"] for i in infos] == [0, 1]
    assert summarize(infos)["env_retokenize_forks"] == 1


def test_code_env_runs_programs_in_the_sandbox_and_answers_with_the_test_runner_output():
    from prl.envs.multi_turn import Episode

    recipe = Recipe.model_validate({"env": {"kind": "code", "max_turns": 3, "max_total_tokens": 64}})
    env = make_env(recipe.env, recipe.task, 0, char_tokenizer(), recipe.sampling, 1, False)
    ex = {"prompt": "rev:abc=", "answer": "cba"}
    tok = char_tokenizer()
    ep = Episode([1])
    assert tok.decode(asyncio.run(env.respond(ep, "p abc", ex))) == " got:abc want:cba="
    assert tok.decode(asyncio.run(env.respond(ep, "q abc", ex))) == " err:unknown op q="
    assert asyncio.run(env.respond(ep, "r abc", ex)) is None  # passes: the episode is over
    assert ep.attempts == [False, False, True] and ep.stats["executions"] == 3
    assert env.score(ep, ex) == 1.0
    env.attempt_penalty = 0.2  # env.attempt_penalty: passing at the third attempt
    assert env.score(ep, ex) == pytest.approx(0.6)
    # per-turn credit: each attempt's own score (abc for cba: half of 1 - 2/3; an error: 0)
    assert env.turn_rewards(ep, ex) == pytest.approx([0.5 / 3, 0.0, 0.6])
    env.fail_credit = 0.0  # env.fail_credit = 0: a failing program scores nothing, however close
    assert env.turn_rewards(ep, ex) == pytest.approx([0.0, 0.0, 0.6])
    # minilang's outcome is a function of target and program: a program already run on this target is
    # answered from the cache, the same answer; on another target it runs again
    again = Episode([1])
    assert tok.decode(asyncio.run(env.respond(again, " p abc ", ex))) == " got:abc want:cba="
    assert again.stats["executions"] == 0 and again.stats["cached"] == 1 and again.attempts == [False]
    other = Episode([1])
    assert tok.decode(asyncio.run(env.respond(other, "p abc", {"prompt": "rev:cab=", "answer": "bac"}))) == \
        " got:abc want:bac="
    assert other.stats["executions"] == 1


def test_minilang_programs_arriving_together_share_a_sandbox_execution_each_with_its_own_answer():
    """A group's programs go to the sandbox as one batch; each gets its own answer. A batch the sandbox
    stops (here its output passes the cap) runs again one program at a time: same answers."""
    from prl.envs.multi_turn import Episode

    programs = ["p abc", "r abc", "q abc", "p cba, p x", "s cab"]
    want = [" got:abc want:cba=", None, " err:unknown op q=", " got:cbax want:cba=", " got:abc want:cba="]
    tok = char_tokenizer()
    ex = {"prompt": "rev:abc=", "answer": "cba"}
    for cap, runs in ((4096, 1), (48, 1 + len(programs))):
        recipe = Recipe.model_validate({"env": {"kind": "code", "max_turns": 3, "max_total_tokens": 64,
                                                "sandbox": {"max_output_bytes": cap}}})
        env = make_env(recipe.env, recipe.task, 0, tok, recipe.sampling, 1, False)

        async def group(env=env):
            eps = [Episode([1]) for _ in programs]
            return eps, await asyncio.gather(*(env.respond(ep, prog, ex) for ep, prog in zip(eps, programs)))

        eps, replies = asyncio.run(group())
        assert [r and tok.decode(r) for r in replies] == want, cap
        assert [ep.attempts for ep in eps] == [[False], [True], [False], [False], [False]]
        assert env.minilang.runs == runs, (cap, env.minilang.runs)  # one batch; or it, then each program alone
    # copies of one program written at the same moment (a group's members): it runs once, the copies wait
    recipe = Recipe.model_validate({"env": {"kind": "code", "max_turns": 3, "max_total_tokens": 64}})
    env = make_env(recipe.env, recipe.task, 0, tok, recipe.sampling, 1, False)

    async def copies():
        eps = [Episode([1]) for _ in range(4)]
        await asyncio.gather(*(env.respond(ep, "p abc", ex) for ep in eps))
        return eps

    eps = asyncio.run(copies())
    assert env.minilang.runs == 1 and sum(ep.stats["cached"] for ep in eps) == 3
    from prl.envs.stats import summarize

    step = summarize([env.info(ep) for ep in eps[1:]])  # a step of cache answers only still reports them
    assert step["sandbox_cached"] == 3 and step["sandbox_executions"] == 0 and step["first_attempt_success"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["code-tiny"])  # tool calls end to end: the server-backed tests above
def test_the_agentic_recipes_run_end_to_end(tmp_path, recipe):
    """A shortened `prl run` of each agentic recipe: multi-turn rollouts (programs in the sandbox, or
    tool calls) reach the trainer, and the step events carry the environment's figures."""
    import json

    from conftest import ROOT, prl_cmd

    p = subprocess.run(prl_cmd("run", ROOT / "recipes" / f"{recipe}.toml", "--no-tui", "--set", "sft.steps=3",
                               "--set", "rl.max_steps=2", "--set", "rl.batch_size=32", "--set",
                               "rl.max_inflight_rollouts=32", "--set", f"run.output_dir={tmp_path}"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / recipe / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "orch_step"]
    assert len(steps) == 2 and all(e["env_turns_mean"] >= 1 and e["env_model_tokens"] > 0 for e in steps)
    if recipe == "code-tiny":
        # every trajectory ran a program (a repeat of one already run on the same target: from the cache)
        assert all(e["sandbox_executions"] > 0 and e["sandbox_executions"] + e["sandbox_cached"] >= 32
                   for e in steps), steps
    else:
        assert all("env_tool_calls_per_turn" in e for e in steps)
    assert sum(e["kind"] == "trainer_step" and e["stage"] == "rl" for e in events) == 2


def test_a_code_demonstrations_failing_attempt_is_a_near_miss_and_never_the_answer():
    import random

    from prl.envs.code_env import mistake
    from prl.tasks.builtin import edit_similarity

    rng = random.Random(0)
    for word in ["a", "ab", "aaa", "abc", "cbadfe"] * 40:
        wrong = mistake(word, rng)
        assert wrong and wrong != word, word
        if len(set(word)) > 1 and sorted(wrong) != sorted(word):  # a shuffle may be far; the edits are near
            assert edit_similarity(wrong, {"answer": word}) >= 0.5, (word, wrong)


def test_the_lookup_reward_counts_characters_past_the_code_against_it():
    from prl.tasks.lookup import reward

    ex = {"answer": "50ae"}
    assert reward("50ae", ex) == 1.0 and reward("50ax", ex) == 0.75
    assert reward("50aexxxx", ex) == 0.5  # an answer that runs on scores less than a short wrong one
    assert reward("", ex) == 0.0


@pytest.mark.parametrize("recipe", ["tool-tiny", "code-tiny"])
def test_the_agentic_recipes_sample_turns_as_long_as_their_demonstrations(recipe):
    """A turn longer than `sampling.max_tokens` is cut while sampling: tool-tiny's 5-letter keys once lost
    their end (`call:get abcde` is 14 tokens and the end-of-turn one, over a cap of 12), so RL could
    never call with the key the warm start taught. The trainer says so at step 0 of the warm start."""
    from conftest import ROOT

    from prl.envs import make_env
    from prl.model.tiny import char_tokenizer
    from prl.recipe.load import load_recipe
    from prl.trainer.trainer import model_turn_lengths

    r = load_recipe(ROOT / "recipes" / f"{recipe}.toml")
    env = make_env(r.env, r.task, 0, char_tokenizer(), r.sampling, 1, False)
    longest = max(max(model_turn_lengths(env.demonstration(i).mask)) for i in range(200))
    assert longest <= r.sampling.max_tokens, (longest, r.sampling.max_tokens)
    assert model_turn_lengths([1, 1, 0, 0, 1, 1, 1, 0, 1]) == [2, 3, 1]
