"""The GRPO tests' seam (train/grpo.py GrpoRecipe.completions_for): completions fixed in place of sampled
ones, in-process (tests/test_grpo.py) and in each rank of a data-parallel run (tests/ddp_worker.py)."""

from __future__ import annotations

from train.grpo import GrpoRecipe

G = 4  # completions per prompt
RIGHT = 2  # of each group's completions, this many are the reference itself (exact_match 1), the rest not


class FixedCompletions(GrpoRecipe):
    """The test seam (GrpoRecipe.completions_for): in each group of G, RIGHT completions are the prompt's
    reference as ids plus eos, the others a wrong query of another length; each step's recorded (`given`)."""

    right = RIGHT
    group = G

    def completions_for(self, prompt_ids):
        references = dict(zip(self.train_set["prompt"], self.train_set["reference"], strict=True))
        text_of = {tuple(ids): text for text, ids in self.prompt_ids.items()}
        tokenizer, eos = self.tokenizer, self.tokenizer.eos_token_id
        out = []
        for index, ids in enumerate(prompt_ids):
            reference = references[text_of[tuple(ids)]]
            place = index % self.group
            text = (
                reference if place < self.right else "SELECT name FROM customers" + " WHERE age > 30" * place
            )
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        self.given = [*getattr(self, "given", []), (prompt_ids, out)]
        return out
