"""Reward functions over per-rollout state: the model must save a word with a tool.

    lachesis env process examples/notes_env.py:NotesEnv --out runs/notes.jsonl \
        --groups 4 --tokenizer runs/tiny-model --inference-servers http://127.0.0.1:9000
"""
from environments import BaseEnv, reward_function, tool

WORDS = ["lachesis", "atropos", "clotho", "spindle", "thread", "loom", "weave"]


@tool(inline=True, state_arg="notes")
def write_note(key: str, text: str, notes: dict) -> str:
    """Save a note under a key.

    Args:
        key: the note's name.
        text: what to save.
    """
    notes[key] = text  # `notes` is this rollout's state, never the model's to set
    return f"saved {key!r}"


class NotesEnv(BaseEnv):
    name = "notes"
    tools = [write_note]

    async def get_next_item(self):
        word = self.rng.choice(WORDS)
        return {"id": word, "word": word}

    def prompt_messages(self, item):
        return [{"role": "user", "content": f"Save the word {item['word']!r} as the note "
                 "'answer' with the write_note tool, then reply DONE."}]

    def new_rollout_state(self, item):
        return {}  # this rollout's notes, shared by its tool calls

    # `notes` below is the snapshot of the state taken when the rollout ended
    @reward_function(weight=1.0)
    def saved(self, item, rollout, notes):
        return float(notes.get("answer") == item["word"])

    @reward_function(weight=0.2)
    def replied_done(self, item, rollout, notes):
        return float(rollout.final_text.strip() == "DONE")

    @reward_function(weight=0.5, per_turn=True)
    def tool_ok(self, item, rollout, notes):
        return [float(bool(t.tool_calls) and not t.tool_errors) for t in rollout.turns]
