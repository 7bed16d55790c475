"""The main job's pieces: an embedded corpus, a small GPT, a trainer with checkpoints."""
