from k3tune.cli import entry

entry()
