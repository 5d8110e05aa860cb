# The GPT demo's loss curves (scripts/demo.sh): gnuplot -e "csv='loss.csv'; png='loss.png'" plot_loss.gp
# The CSV is examples/09_gpt's --csv: step, train loss, validation loss (empty between evaluations).
set datafile separator ','
set terminal pngcairo size 800,480 font ',11'
set output png
set title 'GPT on the fortunes text: cross-entropy (nats per character)'
set xlabel 'step'
set ylabel 'loss'
set key top right
set grid
plot csv using 1:2 every ::1 with lines lw 1 lc rgb '#9ab8d8' title 'train (each step)', \
     csv using 1:($3 == $3 ? $3 : 1/0) every ::1 with linespoints lw 2 pt 7 ps 0.6 lc rgb '#c0392b' title 'validation'
