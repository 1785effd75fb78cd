"""The settings: recipes (`--config`), `--dry-run`, the settings printout, schedules that must fit
the run, and the README's commands, which must run as written."""
import pickle
import re
import shlex
from pathlib import Path

import pytest

import config
from plumbing import flags
import tasks
import tba

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.toml"))


def one_error_line(capsys, message):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    return err[0]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_resolves(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    assert tba.main(["--config", str(recipe), "--dry-run", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"run {out}, task ")
    assert not out.exists()                        # a dry run writes nothing


def test_cpu_recipes_are_the_tasks_own_defaults():
    """recipes/cpu-TASK.toml writes out exactly what `--task TASK` chooses: no drift."""
    assert {p.name for p in RECIPES} >= {f"cpu-{name}.toml" for name in tasks.TASKS}
    for name in tasks.TASKS:
        recipe = flags.read_recipe(REPO / "recipes" / f"cpu-{name}.toml", config.all_fields())
        assert recipe == {"task": name, **tasks.task_class(name).defaults}, name


def test_command_line_overrides_the_recipe(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('task = "toy"\nseed = 5\nlr = 1\ngroup_size = 4\nquiet = true\n')
    cfg, given, actions = config.parse_args(["--config", str(recipe), "--seed", "7"])
    assert (cfg.task, cfg.seed, cfg.lr, cfg.group_size, cfg.quiet) == ("toy", 7, 1.0, 4, True)
    assert isinstance(cfg.lr, float)               # a TOML integer where a float goes
    assert given == {"task", "seed", "lr", "group_size", "quiet"}
    assert actions == {"config": str(recipe), "dry_run": False, "recipe_steps": None,
                       "recipe": {"task": "toy", "lr": 1.0, "group_size": 4, "quiet": True}}


def test_a_range_flag_from_the_command_line_and_from_a_recipe(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("search-temperature = [1, 1.5]\n")
    assert config.parse_args(["--config", str(recipe)])[0].search_temperature == [1.0, 1.5]
    cfg = config.parse_args(["--search-temperature", "0.5", "2"])[0]
    assert cfg.search_temperature == [0.5, 2.0]


BAD_RECIPES = [
    ("unknown key", "task = 'toy'\nbatch-size = 4\n", "unknown key 'batch-size'"),
    ("wrong type", "steps = 'ten'\n", "steps = 'ten' must be an integer"),
    ("float for an integer", "steps = 10.5\n", "steps = 10.5 must be an integer"),
    ("bool for an integer", "group-size = true\n", "group-size = True must be an integer"),
    ("string for a bool", "quiet = 'yes'\n", "quiet = 'yes' must be true or false"),
    ("out of range", "beta = -0.1\n", "beta = -0.1 must be at least 0.0001"),
    ("not a choice", "loss = 'ppo'\n", "loss = 'ppo' must be one of tb, rloo"),
    ("NaN", "lr = nan\n", "lr = nan must be greater than 0"),
    ("invalid TOML", "steps = = 3\n", "is not valid TOML"),
    ("a table", "[optimiser]\nlr = 1e-5\n", "unknown key 'optimiser'"),
    ("set twice", "group-size = 4\ngroup_size = 8\n", "'group_size' is set twice"),
    ("resume in a recipe", "resume = 'runs/x'\n", "unknown key 'resume'"),
    ("one number for a range", "search-temperature = 1.5\n",
     "search-temperature = 1.5 must be two numbers, [LOW, HIGH]"),
    ("three numbers", "search-temperature = [1, 2, 3]\n", "must be two numbers, [LOW, HIGH]"),
    ("a range upside down", "search-temperature = [2, 1]\n",
     "search-temperature = [2.0, 1.0] must be two numbers 0 < LOW <= HIGH"),
]


@pytest.mark.parametrize("text, message", [case[1:] for case in BAD_RECIPES],
                         ids=[case[0] for case in BAD_RECIPES])
def test_bad_recipe_is_one_line_naming_the_file_and_exit_2(text, message, tmp_path, capsys):
    recipe = tmp_path / "bad.toml"
    recipe.write_text(text)
    out = tmp_path / "run"
    assert tba.main(["--config", str(recipe), "--out", str(out)]) == 2
    assert str(recipe) in one_error_line(capsys, message)      # names the file and the key
    assert not out.exists()


def test_bad_recipe_errors_name_the_file(tmp_path, capsys):
    recipe = tmp_path / "bad.toml"
    recipe.write_text("steps = 0\n")
    assert tba.main(["--config", str(recipe)]) == 2
    one_error_line(capsys, f"{recipe}: steps = 0 must be at least 1")
    assert tba.main(["--config", str(tmp_path / "missing.toml")]) == 2
    one_error_line(capsys, f"--config {tmp_path / 'missing.toml'}: no such file")


def test_dry_run_prints_the_settings_that_differ_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert tba.main(["--task", "arith", "--lr", "1e-4", "--searchers", "0", "--dry-run",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"run {out}, task arith")
    words = printed.split()
    assert "lr=0.0001" in words and "searchers=0" in words     # given: no mark
    assert "steps=100*" in words and "beta=0.05*" in words      # the task's choice: marked
    assert not any(w.startswith(("seed=", "loss=", "keep-checkpoints=")) for w in words)  # defaults
    assert not out.exists()


def test_a_dry_run_times_nothing(tmp_path, monkeypatch):
    """--dtype auto on a CPU times a matmul to choose bfloat16 or float32: a run does, a dry run
    leaves it auto (the run that follows chooses)."""
    from llm import precision

    def timed():
        raise AssertionError("a dry run timed a matmul")
    monkeypatch.setattr(precision, "cpu_bfloat16_is_faster", timed)
    assert tba.main(["--task", "toy", "--device", "cpu", "--dry-run",
                     "--out", str(tmp_path / "run")]) == 0
    cfg = config.resolve(config.parse_args(["--task", "toy", "--device", "cpu"])[0],
                         measure=False)
    assert cfg.dtype == "auto"
    with pytest.raises(AssertionError, match="timed a matmul"):
        config.resolve(config.parse_args(["--task", "toy", "--device", "cpu"])[0])


def test_a_short_run_gets_the_tasks_schedule_fitted_visibly(tmp_path, capsys):
    """--task toy --steps 100: the toy's 10 + 300 steps of warm-up and decay and 1,000 of β
    annealing are for 1,500 steps; shrunk in proportion, and the printout says so."""
    cfg = config.resolve(config.parse_args(["--task", "toy", "--steps", "100"])[0])
    assert (cfg.warmup_steps, cfg.decay_steps, cfg.beta_steps) == (1, 20, 67)
    assert tba.main(["--task", "toy", "--steps", "100", "--dry-run", "--out", str(tmp_path)]) == 0
    assert ("fitted to --steps 100: the task's schedule (warmup-steps 10, decay-steps 300, "
            "beta-steps 1000) is for 1500 steps") in capsys.readouterr().out
    full = config.resolve(config.parse_args(["--task", "toy"])[0])        # fits: unchanged
    assert (full.warmup_steps, full.decay_steps, full.beta_steps) == (10, 300, 1000)


def test_a_recipe_schedule_is_fitted_as_the_tasks(tmp_path, capsys):
    """recipes/cpu-arith.toml is exactly --task arith: a shorter run of either gets the same
    schedule, fitted, and says so; only schedules from the command line are refused."""
    recipe = REPO / "recipes" / "cpu-arith.toml"
    fitted = config.resolve(config.parse_args(["--task", "arith", "--steps", "12"])[0])
    cfg, _, actions = config.parse_args(["--config", str(recipe), "--steps", "12"])
    from_recipe = config.resolve(cfg, recipe=actions["recipe"])
    assert (from_recipe.warmup_steps, from_recipe.decay_steps) == (
        fitted.warmup_steps, fitted.decay_steps) == (1, 1)
    assert tba.main(["--config", str(recipe), "--steps", "12", "--dry-run",
                     "--out", str(tmp_path)]) == 0
    assert ("fitted to --steps 12: the recipe's schedule (warmup-steps 5, decay-steps 10) is "
            "for 100 steps") in capsys.readouterr().out
    capsys.readouterr()
    assert tba.main(["--config", str(recipe), "--steps", "12", "--decay-steps", "12",
                     "--out", str(tmp_path / "run")]) == 2      # 1 fitted + 12 given: refused
    one_error_line(capsys, "does not fit in --steps 12: --warmup-steps 1 + --decay-steps 12")


@pytest.mark.parametrize("args, message", [
    (["--steps", "10", "--decay-steps", "50"], "does not fit in --steps 10: --warmup-steps 0 + "
                                               "--decay-steps 50 = 50"),
    (["--steps", "10", "--warmup-steps", "6", "--decay-steps", "6"], "= 12: shorten them"),
    (["--steps", "10", "--beta-steps", "11"], "--beta-steps 11 is longer than the run's --steps 10"),
    (["--warmup-steps", "1500", "--decay-steps", "1"], "does not fit in --steps 1500"),
])
def test_a_schedule_the_user_gave_that_does_not_fit_is_refused(args, message, tmp_path, capsys):
    assert tba.main(["--task", "toy", *args, "--out", str(tmp_path / "run")]) == 2
    one_error_line(capsys, message)
    assert not (tmp_path / "run").exists()


def readme_commands():
    """Every `python tba.py ...` line inside a fenced code block of the README."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("python tba.py") and " plot " not in line]


def test_readme_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """Each training command of the README resolves, checked, with --dry-run (nothing loaded)."""
    commands = readme_commands()
    assert len(commands) >= 3
    monkeypatch.chdir(REPO)
    for command in commands:
        argv = shlex.split(command)[2:]
        assert tba.main([*argv, "--dry-run", "--out", str(tmp_path / "run")]) == 0, command
        assert capsys.readouterr().err == "", command


def test_each_task_owns_its_settings(tmp_path, monkeypatch):
    """Config holds the core settings; a task declares its own (Task.Settings), which a run of it
    gets, --help lists under it, a run of another task refuses, and a task of your own brings."""
    import dataclasses
    core = {f.name for f in dataclasses.fields(config.Config)}
    assert len(core) <= 56 and not core & {"arith_digits", "victim_model", "data_dir"}
    cfg = config.parse_args(["--task", "arith", "--arith-digits", "2"])[0]
    assert cfg.arith_digits == 2 and not hasattr(config.parse_args([])[0], "arith_digits")
    assert pickle.loads(pickle.dumps(cfg)) == cfg          # as a spawned searcher receives it
    help_text = config.build_parser().format_help()
    under_arith = help_text[help_text.index("settings of arith"):]
    assert "\n  --arith-digits" in under_arith and "\n  --arith-digits" not in help_text.split(
        "settings of")[0]
    with pytest.raises(ValueError, match="--arith-digits is a setting of arith, not of --task toy"):
        config.parse_args(["--arith-digits", "2"])
    (tmp_path / "my_task.py").write_text(
        "from dataclasses import dataclass\nfrom plumbing.flags import flag\n"
        "from tasks.toy import ToyTask\n@dataclass\nclass MySettings:\n    \"\"\"mine.\"\"\"\n"
        "    noise: float = flag(0.5, 'how noisy')\nclass MyTask(ToyTask):\n"
        "    Settings = MySettings\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config.parse_args(["--task", "my_task:MyTask", "--noise", "0.25"])[0]
    assert cfg.noise == 0.25 and cfg.task == "my_task:MyTask"
