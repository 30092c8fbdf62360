"""make run's stack under a steady load for a long while, watched for what grows: the run (`run`), what each sample
holds (`records`), its windows, the analysis (fits against TTLs) and the report. Imports the stack, meters and load
wings."""
