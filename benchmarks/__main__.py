from benchmarks.run import main

if __name__ == "__main__":  # not when pytest imports this module for its doctests
    main()
