from prl.cli import app

app()
