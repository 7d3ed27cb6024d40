from prl.cli import app

app(prog_name="prl")
