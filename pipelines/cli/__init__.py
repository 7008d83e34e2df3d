"""The command line: `polydraft run | check | plan | status | study | publish | recipes` (`main`), and the
report of a run directory's state that `polydraft status` prints (`status`)."""
