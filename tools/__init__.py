"""Programs around the product: ``commands/`` (the CLI verbs' implementations), ``testing/`` (stand-ins the tests and
``gpu-check --emulate`` use), ``recipe/`` (how ``fixture/`` was trained). ``tools/lab/`` (research instruments) sits
beside them in the source tree but is not installed."""
