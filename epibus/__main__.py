from epibus.cli import main

main()
