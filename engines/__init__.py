"""The engines that run the search: where each step's groups come from (sources.py: this
process, searcher processes or Ray actors), the searcher processes and the buffer they fill
(async_source.py, processes.py), and Ray actors on several machines (ray_source.py)."""
