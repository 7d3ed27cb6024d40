"""An environment of your own: a guessing game over several turns.

The model guesses a secret number from 1 to 32; the environment answers "higher" or "lower" until the
guess is right or the turns run out. The environment's answers are appended as token ids with loss
mask 0 (the model is never trained to write them); the reward scores the model's last guess."""

import random

from prl.envs import EnvWorkload, Episode, MultiTurnEnv

LOW, HIGH = 1, 32


def secrets(index: int, seed: int, min_len: int, max_len: int) -> dict:
    """The task's dataset: example `index` is a secret number (min_len and max_len are not used)."""
    rng = random.Random(seed * 1_000_003 + index)
    return {"prompt": f"guess {LOW}-{HIGH}:", "answer": str(rng.randint(LOW, HIGH))}


def reward(completion: str, example: dict) -> float:
    return float(completion.strip() == example["answer"])


class GuessEnv(MultiTurnEnv):
    # What prl asks of an environment class before anything starts:
    multi_turn = True  # turns: the environment answers between the model's guesses
    needs_sandbox = False  # no model-written code runs, so no sandbox workers

    @classmethod
    def workload(cls, cfg, sampling) -> EnvWorkload:
        """What `prl plan` assumes: a binary search takes about log2(32) = 5 guesses, and each answer
        (" higher=") is 8 tokens of prl's character-level tokenizer."""
        return EnvWorkload(turns=5, env_tokens_per_turn=8, max_tokens=cfg.max_total_tokens)

    async def respond(self, ep: Episode, text: str, example: dict) -> list[int] | None:
        """The environment's answer to the model's turn `text`, as token ids; None ends the episode."""
        guess, secret = text.strip(), int(example["answer"])
        if guess == example["answer"]:
            return None
        if not guess.isdigit():
            answer = "a number"
        else:
            answer = "higher" if int(guess) < secret else "lower"
        ep.replies.append(answer)
        return self.fmt.reply_ids("feedback", answer)  # " higher=" for the tiny model, a chat message otherwise

    def score(self, ep: Episode, example: dict) -> float:
        """The reward of the whole episode: the task's reward on the model's last guess."""
        return self.task.reward(ep.last_text, example)

    def demonstration(self, index: int):
        """A worked episode for the warm start (`[sft]`): a binary search. The guesses are learned (mask
        1); the environment's answers are context (mask 0)."""
        example = self.example(index)
        ep = Episode(self.prompt_ids(example))
        low, high, secret = LOW, HIGH, int(example["answer"])
        while True:
            guess = (low + high) // 2
            self.model_turn(ep, str(guess))
            if guess == secret:
                return self.demo(ep)
            self.env_turn(ep, self.fmt.reply_ids("feedback", "higher" if guess < secret else "lower"))
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
