from lockstep.cli import main

main(prog_name="lockstep")
