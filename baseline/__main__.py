from baseline.server import main

main()
