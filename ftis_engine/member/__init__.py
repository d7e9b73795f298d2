"""A member of the run: its model (+ LoRA), tokenizer, optimizer on float32 masters and generator, composed in one
place (`members.Member`, `members.build_member`)."""
