"""How the replay buffer (buffer.py) keeps completions and picks them: what is stored and what
makes way (storage.py), how a prompt and its completions are drawn (draws.py), and the check of
its saved state before a resumed run loads it (saved_state.py)."""
