"""How the replay buffer (buffer.py) keeps completions and picks them: what is stored and what
makes way (storage.py), and how a prompt and its completions are drawn (draws.py)."""
