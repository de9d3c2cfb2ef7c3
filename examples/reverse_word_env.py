"""A user environment in one file: spell a word backwards, with a tool that can do it.

    lachesis env process examples/reverse_word_env.py:ReverseWordEnv --out runs/reverse.jsonl \
        --groups 4 --tokenizer runs/tiny-model --inference-servers http://127.0.0.1:9000
"""
from environments import BaseEnv, TurnLevelRewardMixin, tool

WORDS = ["lachesis", "atropos", "clotho", "spindle", "thread", "loom", "weave"]


@tool
def reverse(text: str) -> str:
    """Reverse a string.

    Args:
        text: the string to reverse.
    """
    return text[::-1]


class ReverseWordEnv(TurnLevelRewardMixin, BaseEnv):
    name = "reverse_word"
    tools = [reverse]

    async def get_next_item(self):
        word = self.rng.choice(WORDS)  # self.rng is seeded from config.seed
        return {"id": word, "word": word}

    def prompt_messages(self, item):
        return [{"role": "user", "content": f"Spell {item['word']!r} backwards: call the "
                 "reverse tool, then answer as <answer>...</answer>."}]

    def compute_turn_rewards(self, item, rollout):
        # One reward per assistant turn: tool turns earn 1 if a result was the answer;
        # the last turn (the outcome) earns 1 for the right answer in tags.
        target = item["word"][::-1]
        tool_turns = [float(target in t.tool_results) for t in rollout.turns[:-1]]
        return tool_turns + [float(f"<answer>{target}</answer>" in rollout.final_text)]
