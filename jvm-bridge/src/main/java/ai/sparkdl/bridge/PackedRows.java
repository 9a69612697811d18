package ai.sparkdl.bridge;

import java.io.Serializable;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.Arrays;
import java.util.Iterator;
import java.util.NoSuchElementException;

import org.apache.spark.api.java.JavaRDD;
import org.apache.spark.api.java.function.FlatMapFunction;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;

/**
 * A prepared DataFrame of numeric scalar columns delivered in blocks of rows (issue 30): each output
 * row holds up to {@code blockRows} input rows as little-endian bytes, one binary column per group of
 * input columns, row-major (the features group is the rank's (rows, features) float32 block as
 * numpy views it). Spark's own Arrow delivery builds an array per row and writes it element by
 * element; here the executor reads each row's values once and the Arrow writer copies one buffer
 * per block. The grouping comes from Python ({@code groups[i]}: the output column of input column
 * i); every column of a group must have the same type, written as it is (float32, int32, int64).
 */
public final class PackedRows {
    private PackedRows() {
    }

    static final int FLOAT = 0;
    static final int INT = 1;
    static final int LONG = 2;

    /** The packed DataFrame, one partition per partition of {@code prepared} (the rows keep their order). */
    public static Dataset<Row> pack(Dataset<Row> prepared, int[] groups, String[] names, int blockRows) {
        StructField[] fields = prepared.schema().fields();
        if (groups.length != fields.length) {
            throw new IllegalArgumentException("groups has " + groups.length + " entries for " + fields.length
                    + " columns");
        }
        int[] kinds = new int[fields.length];
        for (int i = 0; i < fields.length; i++) {
            kinds[i] = kindOf(fields[i]);
        }
        StructField[] out = new StructField[names.length];
        for (int g = 0; g < names.length; g++) {
            out[g] = DataTypes.createStructField(names[g], DataTypes.BinaryType, false);
        }
        JavaRDD<InternalRow> rows = prepared.queryExecution().toRdd().toJavaRDD();
        JavaRDD<Row> packed = rows.mapPartitions(new Packer(kinds, groups, names.length, blockRows));
        return prepared.sparkSession().createDataFrame(packed, new StructType(out));
    }

    private static int kindOf(StructField field) {
        DataType type = field.dataType();
        if (type.equals(DataTypes.FloatType)) {
            return FLOAT;
        }
        if (type.equals(DataTypes.IntegerType)) {
            return INT;
        }
        if (type.equals(DataTypes.LongType)) {
            return LONG;
        }
        throw new IllegalArgumentException("column " + field.name() + " has type " + type.simpleString()
                + ": only float, int and bigint columns are packed");
    }

    static final class Packer implements FlatMapFunction<Iterator<InternalRow>, Row>, Serializable {
        private static final long serialVersionUID = 1L;
        private final int[] kinds;
        private final int[] groups;
        private final int groupCount;
        private final int blockRows;

        Packer(int[] kinds, int[] groups, int groupCount, int blockRows) {
            this.kinds = kinds;
            this.groups = groups;
            this.groupCount = groupCount;
            this.blockRows = Math.max(1, blockRows);
        }

        @Override
        public Iterator<Row> call(Iterator<InternalRow> input) {
            int[] rowBytes = new int[groupCount];
            for (int i = 0; i < kinds.length; i++) {
                rowBytes[groups[i]] += kinds[i] == LONG ? 8 : 4;
            }
            return new Iterator<Row>() {
                @Override
                public boolean hasNext() {
                    return input.hasNext();
                }

                @Override
                public Row next() {
                    if (!input.hasNext()) {
                        throw new NoSuchElementException();
                    }
                    ByteBuffer[] out = new ByteBuffer[groupCount];
                    for (int g = 0; g < groupCount; g++) {
                        out[g] = ByteBuffer.allocate(rowBytes[g] * blockRows).order(ByteOrder.LITTLE_ENDIAN);
                    }
                    int rows = 0;
                    while (rows < blockRows && input.hasNext()) {
                        InternalRow row = input.next();
                        for (int i = 0; i < kinds.length; i++) {
                            if (row.isNullAt(i)) {
                                throw new IllegalStateException("column " + i + " holds a null: the driver's "
                                        + "checks should have refused it");
                            }
                            ByteBuffer target = out[groups[i]];
                            switch (kinds[i]) {
                                case FLOAT: target.putFloat(row.getFloat(i)); break;
                                case INT: target.putInt(row.getInt(i)); break;
                                default: target.putLong(row.getLong(i)); break;
                            }
                        }
                        rows++;
                    }
                    Object[] values = new Object[groupCount];
                    for (int g = 0; g < groupCount; g++) {
                        byte[] bytes = out[g].array();
                        values[g] = rows == blockRows ? bytes : Arrays.copyOf(bytes, rows * rowBytes[g]);
                    }
                    return RowFactory.create(values);
                }
            };
        }
    }
}
