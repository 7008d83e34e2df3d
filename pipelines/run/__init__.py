"""Running a recipe: loading it with its overrides (`recipe`), checking every input before the first stage
(`preflight`), taking the run directory (`rundir`), running the stages in order and reusing the outputs
whose keys match (`runner`, `fingerprint`), and the summary printed at the end (`summary`)."""
